"""What ``bf16.bf16_master_weights_and_grads``, ``bf16.bf16_optimizer_states`` and
``torch_autocast`` accept together with the other keys, checked once the file is valid.

DeepSpeed 0.19.8's rules, with its messages where it asserts (``runtime/config.py`` and
``base_optimizer._configure_master_weights``), and zerotrain's refusals, each naming the
key, for the combinations it does not implement. Apart from ``checks.py`` because these
keys are one feature: keeping training state in 16 bits.
"""
from __future__ import annotations

from ..errors import AssertedConfigError, ConfigError
from .schema import ZeroTrainConfig
from .sections import AUTOCAST_DTYPES

_MASTER = "bf16.bf16_master_weights_and_grads"
_STATES = "bf16.bf16_optimizer_states"


def check_bf16_masters(result: ZeroTrainConfig) -> None:
    """The two bf16 keys: stages 1-3 only, states only with bf16 masters (DeepSpeed's
    asserts); bf16 masters need bf16 parameters and bf16 gradients, and masters in bf16
    with fp32 moments (DeepSpeed: only through its CPU Adam) are not implemented."""
    bf16, stage = result.bf16, result.zero_optimization.stage
    if bf16.bf16_master_weights_and_grads and stage not in (1, 2, 3):
        raise AssertedConfigError(_MASTER, "Bf16_master_weights_and_grads is only supported "
                                  f"with ZeRO Stage 1, 2, or 3 (stage {stage} here)", value=True)
    if bf16.bf16_optimizer_states and stage not in (1, 2, 3):
        raise AssertedConfigError(_STATES, "bf16_optimizer_states is only supported with "
                                  f"ZeRO Stage 1, 2, or 3 (stage {stage} here)", value=True)
    if bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        raise AssertedConfigError(_STATES, "bf16_optimizer_states requires "
                                  "bf16_master_weights_and_grads to be enabled", value=True)
    if not bf16.bf16_master_weights_and_grads:
        return
    if not bf16.enabled:
        raise ConfigError(_MASTER, "keeps the master weights in bf16, which needs bf16 "
                          "parameters; set bf16.enabled true", value=True)
    accum = result.data_types.grad_accum_dtype
    if accum not in (None, "bf16"):
        raise ConfigError("data_types.grad_accum_dtype", f"{accum!r} contradicts "
                          f"{_MASTER}, which keeps the gradients in bf16; remove the key or "
                          'set it to "bf16"', value=accum)
    if not bf16.bf16_optimizer_states:
        raise ConfigError(_MASTER, "without bf16.bf16_optimizer_states keeps bf16 master "
                          "weights beside fp32 Adam moments, which DeepSpeed runs only with "
                          "offload_optimizer and its CPU Adam; zerotrain does not implement "
                          "it: set bf16.bf16_optimizer_states true too (masters, gradients "
                          "and moments in bf16) or remove the key", value=True)
    offload = result.zero_optimization.offload_optimizer
    if offload is not None and offload.device == "nvme":
        raise ConfigError("zero_optimization.offload_optimizer.device", "nvme with "
                          f"{_MASTER} is not implemented (the swapped optimizer state is fp32); "
                          'use "cpu" or "none"', value="nvme")


def check_torch_autocast(result: ZeroTrainConfig) -> None:
    """``torch_autocast`` runs the forward under ``torch.autocast`` over fp32 or bf16
    parameters (DeepSpeed's bf16 example sets it beside ``bf16``); refused beside ``fp16``
    (DeepSpeed would reduce the gradients of its Linear layers in the autocast dtype and the
    others in fp16) and with an fp16 dtype (DeepSpeed's GradScaler path, not implemented).
    Which parameters it reduces in another dtype is checked against the model at
    ``initialize`` (``engine/autocast.py``)."""
    section = result.torch_autocast
    if not section.enabled:
        return
    if result.fp16.enabled:
        raise ConfigError("torch_autocast.enabled", "torch_autocast beside fp16.enabled (fp16 "
                          "parameters) is not implemented; use bf16.enabled or fp32 "
                          "parameters", value=True)
    if section.dtype is not None and AUTOCAST_DTYPES[section.dtype] == "fp16":
        raise ConfigError("torch_autocast.dtype", "fp16 autocast (DeepSpeed scales its loss "
                          "with torch.amp.GradScaler) is not implemented; use \"bfloat16\"",
                          value=section.dtype)
