"""``deepspeed.runtime.zero.offload_config``'s enums: where states go, and which states
``engine.offload_states(include=...)`` moves (RLHF frameworks free accelerator memory with it
between generation and training)."""
from __future__ import annotations

import enum

from .config.deepspeed_zero import (DeepSpeedZeroOffloadOptimizerConfig,
                                    DeepSpeedZeroOffloadParamConfig)

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, enum.Enum):
    """An offload target, as DeepSpeed spells it in its config and API."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """A kind of training state ``offload_states`` can move."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
