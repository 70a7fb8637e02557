"""The smaller sections: precision, optimizer and scheduler, checkpoints, activation
checkpointing and compile.

Each mirrors one DeepSpeed JSON section with DeepSpeed's keys and defaults, so an existing
``ds_config.json`` loads unchanged; the whole file is ``schema.ZeroTrainConfig``.
"""
from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Type

from pydantic import Field

from .fields import NonNegative, PrecisionName, Size, _Section


class CheckpointWriterConfig(_Section):
    """DeepSpeed's ``checkpoint.writer``: ``decoupled`` makes every ``save_checkpoint`` an
    asynchronous save (it returns once the state is staged in host memory; docs/checkpoints.md);
    DeepSpeed's I/O tuning keys (``type``, ``io_buffer_size`` ...) are accepted and ignored."""

    decoupled: bool = False


class CheckpointConfig(_Section):
    """``auto_resume``: a save directory; when it holds a ``latest`` tag, ``initialize`` loads
    it, so a job restarted by torchrun continues where the last complete save left off."""

    auto_resume: Optional[str] = None
    writer: Optional[CheckpointWriterConfig] = None


# The largest loss scale: 2**64, finite in fp32 (whose largest power of two is 2**127) and
# what a checkpoint's loss scaler may hold (checkpoint/match.py); fp16 gradients overflow
# long before it. DeepSpeed bounds none of these, and 2**1000 is inf in fp32: every step is
# then skipped as an overflow, with no error.
MAX_SCALE_POWER = 64
MAX_LOSS_SCALE = 2.0 ** MAX_SCALE_POWER


class FP16Config(_Section):
    """DeepSpeed's ``fp16`` section. Scales are bounded by ``MAX_LOSS_SCALE`` (a larger one
    is inf in fp32 or refused by a resume); ``min_loss_scale`` above the initial scale is
    refused in ``checks.py``."""

    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0, le=MAX_LOSS_SCALE)  # 0 means dynamic loss scaling
    initial_scale_power: int = Field(16, ge=0, le=MAX_SCALE_POWER)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0, le=MAX_LOSS_SCALE)
    auto_cast: bool = False
    fp16_master_weights_and_grads: bool = False


class BF16Config(_Section):
    """``auto_cast`` is zerotrain's opt-in, not DeepSpeed's: the engine casts floating
    inputs to bf16 as ``fp16.auto_cast`` casts them to fp16 (DeepSpeed has only the latter
    and leaves bf16 inputs as given).

    ``bf16_master_weights_and_grads``: the master weights and the reduced gradients are
    kept in bf16, not fp32; ``bf16_optimizer_states``: the optimizer's state too (DeepSpeed's
    keys and checks, ``precision_checks.check_bf16_masters``; Note "bf16 masters" in
    ``core/precision.py``)."""

    enabled: bool = False
    auto_cast: bool = False
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


# torch_autocast.dtype: DeepSpeed's DtypeEnum spellings of the 16-bit types
AUTOCAST_DTYPES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
                   "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16"}


class TorchAutocastConfig(_Section):
    """DeepSpeed's ``torch_autocast``: the engine's forward under ``torch.autocast``
    (``dtype``; unset: torch's default for the device) over fp32 or bf16 parameters, and the
    gradients of the parameters of ``lower_precision_safe_modules`` (default: torch's Linear
    and Conv1d/2d/3d) reduced in that dtype (what zerotrain honours: Note "what is
    honoured" in ``engine/autocast.py``)."""

    enabled: bool = False
    dtype: Optional[Literal["fp16", "float16", "half", "torch.float16", "bf16", "bfloat16",
                            "torch.bfloat16"]] = None
    lower_precision_safe_modules: Optional[List[str]] = None


class DataTypesConfig(_Section):
    grad_accum_dtype: Optional[PrecisionName] = None


class AdamParams(_Section):
    """Keys allowed in ``optimizer.params`` for Adam and AdamW; unset keys keep torch's default."""

    lr: Optional[NonNegative] = None
    betas: Optional[List[Annotated[float, Field(ge=0, lt=1)]]] = Field(
        None, min_length=2, max_length=2)
    eps: Optional[NonNegative] = None
    weight_decay: Optional[NonNegative] = None
    amsgrad: Optional[bool] = None
    adam_w_mode: Optional[bool] = None
    bias_correction: Optional[bool] = None
    torch_adam: Optional[bool] = None
    fused: Optional[bool] = None
    foreach: Optional[bool] = None


class SGDParams(_Section):
    """Keys allowed in ``optimizer.params`` for SGD; unset keys keep torch's default."""

    lr: Optional[NonNegative] = None
    momentum: Optional[NonNegative] = None
    dampening: Optional[NonNegative] = None
    weight_decay: Optional[NonNegative] = None
    nesterov: Optional[bool] = None


class MuonParams(_Section):
    """Keys allowed in ``optimizer.params`` for Muon (DeepSpeed's ``MuonWithAuxAdam``):
    ``lr``, ``weight_decay`` shared by both halves, ``muon_lr`` / ``adam_lr`` for one;
    ``momentum`` and ``ns_method`` for the Muon half, ``betas`` and ``eps`` for the AdamW
    half; ``torch_adam`` is accepted without effect (the AdamW half is always zerotrain's)."""

    lr: Optional[NonNegative] = None
    muon_lr: Optional[NonNegative] = None
    adam_lr: Optional[NonNegative] = None
    momentum: Optional[Annotated[float, Field(ge=0, lt=1)]] = None
    weight_decay: Optional[NonNegative] = None
    ns_method: Optional[Literal["gram", "standard"]] = None
    betas: Optional[List[Annotated[float, Field(ge=0, lt=1)]]] = Field(
        None, min_length=2, max_length=2)
    eps: Optional[NonNegative] = None
    adam_w_mode: Optional[bool] = None
    torch_adam: Optional[bool] = None


OPTIMIZER_PARAMS: Dict[str, Type[_Section]] = {
    "Adam": AdamParams, "AdamW": AdamParams, "SGD": SGDParams, "Muon": MuonParams}
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


class OptimizerConfig(_Section):
    """``params`` holds only the keys the user set, validated, with ``betas`` as a tuple."""

    type: Literal["Adam", "AdamW", "SGD", "Muon"]
    params: Dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(_Section):
    """``params`` is stored as given; the scheduler module validates its keys."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
    params: Dict[str, Any] = Field(default_factory=dict)


class ActivationCheckpointingConfig(_Section):
    """DeepSpeed's ``activation_checkpointing`` section, used by ``zerotrain.checkpointing``.

    ``cpu_checkpointing`` keeps checkpointed inputs in host memory; ``synchronize_checkpoint_
    boundary`` synchronizes CUDA around each checkpointed segment; ``profile`` logs each
    segment's forward and recomputation time at DEBUG. ``partition_activations`` and
    ``contiguous_memory_optimization`` (with ``number_checkpoints`` buffers) only act across
    a model-parallel group; in data-parallel training they change nothing (Note "options
    that need model parallelism" in ``recompute.py``).
    """

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[Size] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


TORCH_COMPILE_KWARGS = ("mode", "fullgraph", "dynamic", "options", "disable")


class CompileConfig(_Section):
    """``torch.compile`` of the model by the engine (``docs/compile.md``).

    ``enabled``: ``initialize`` calls ``engine.compile`` with ``backend`` and ``kwargs``
    (any of ``TORCH_COMPILE_KWARGS``); ``fallback``: null (a block that fails to compile
    raises an error naming it and the backend) or "eager" (such a block runs eagerly).
    """

    enabled: bool = False
    backend: str = "inductor"
    kwargs: Dict[str, Any] = Field(default_factory=dict)
    fallback: Optional[Literal["eager"]] = None
