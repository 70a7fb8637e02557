"""``ZeroTrainConfig``: the whole validated file, what every component is handed.

Only the top-level keys and the derived views (precision, reduction dtype) live here; the
sections are in ``zero.py`` and ``sections.py``, and ``reader.load_config`` builds it.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field, PrivateAttr, field_validator

from .fields import NonNegative, PrecisionName, _Section
from .sections import (ActivationCheckpointingConfig, BF16Config, CheckpointConfig,
                       CompileConfig, DataTypesConfig, FP16Config, OptimizerConfig,
                       SchedulerConfig, TorchAutocastConfig)
from .tensor_parallel import TensorParallelConfig
from .zero import ZeroConfig


class ZeroTrainConfig(_Section):
    """The whole validated config; build it with ``load_config``, which resolves the batch sizes."""

    train_batch_size: int = Field(ge=1)
    train_micro_batch_size_per_gpu: int = Field(ge=1)
    gradient_accumulation_steps: int = Field(ge=1)
    gradient_clipping: NonNegative = 0.0
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    # Ulysses: ranks sharing each sequence (zerotrain.sequence; 1: off)
    sequence_parallel_size: int = Field(1, ge=1)
    steps_per_print: Union[int, float] = 10   # a whole number >= 1, or inf: never (Accelerate)
    wall_clock_breakdown: bool = False
    communication_data_type: Optional[PrecisionName] = None   # gradient reductions
    gradient_allreduce_op: str = "mean"   # DeepSpeed's; only "mean" is implemented (checks)
    zero_allow_untested_optimizer: bool = False   # step a non-elementwise client optimizer
    zero_force_ds_cpu_optimizer: bool = True   # offload_optimizer: DeepSpeedCPUAdam only
    # false: every step() is the accumulation boundary (Note in engine/accumulation.py)
    managed_gradient_accumulation: bool = True
    # zerotrain's own keys (not DeepSpeed's)
    comms_timeout: float = Field(1800.0, gt=0, le=31_536_000, allow_inf_nan=False)  # s
    nonfinite: Literal["raise", "skip"] = "raise"  # bf16/fp32 inf/nan gradients
    debug: bool = False                            # log every collective as launched
    # a vote before each backward that reduces, and each update (engine/accumulation.py)
    backward_votes: bool = True

    @field_validator("steps_per_print", mode="wrap")
    @classmethod
    def _whole_or_never(cls, value: Any, handler: Any) -> Union[int, float]:
        """A whole number of steps >= 1, or ``inf`` (never print), as DeepSpeed accepts."""
        if isinstance(value, float) and value == math.inf:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError("must be a whole number of steps >= 1, or inf (never print)")
        return value

    _raw: Dict[str, Any] = PrivateAttr(default_factory=dict)
    _unimplemented: List[str] = PrivateAttr(default_factory=list)
    _ignored: List[str] = PrivateAttr(default_factory=list)

    @property
    def precision(self) -> PrecisionName:
        if self.fp16.enabled:
            return "fp16"
        return "bf16" if self.bf16.enabled else "fp32"

    @property
    def comm_dtype(self) -> PrecisionName:
        """The gradient reductions' dtype: the gradients' own (the parameter dtype) unless
        ``communication_data_type`` is set, as in DeepSpeed."""
        return self.communication_data_type or self.precision

    @property
    def grad_accum_dtype(self) -> PrecisionName:
        """fp32 unless set: accumulating many micro-batches in 16 bits loses small gradients.
        bf16 with ``bf16.bf16_master_weights_and_grads``, which keeps gradients in bf16."""
        default = "bf16" if self.bf16.bf16_master_weights_and_grads else "fp32"
        return self.data_types.grad_accum_dtype or default

    @property
    def master_dtype(self) -> PrecisionName:
        """What the optimizer steps: fp32 masters, bf16 with
        ``bf16.bf16_master_weights_and_grads``."""
        return "bf16" if self.bf16.bf16_master_weights_and_grads else "fp32"

    @property
    def raw(self) -> Dict[str, Any]:
        """A deep copy of the user's config, for features that read keys the models lack."""
        return self._raw

    def get(self, key: str, default: Any = None) -> Any:
        """``engine.config.get(key)``: DeepSpeed's ``engine.config`` is the user's dict, and
        transformers reads it so (``config.get("zero_optimization", {}).get("stage")``)."""
        return self._raw.get(key, default)

    @property
    def unimplemented_keys(self) -> List[str]:
        """Dotted paths of the DeepSpeed keys that were accepted but have no effect."""
        return list(self._unimplemented)

    @property
    def ignored_keys(self) -> List[str]:
        """What was read as DeepSpeed reads it, by ignoring it: top-level keys DeepSpeed does
        not know, "auto" values it drops (each with why)."""
        return list(self._ignored)
