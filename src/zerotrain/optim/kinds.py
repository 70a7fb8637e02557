"""DeepSpeed's optimizer wrapper classes, for ``isinstance`` checks on ``engine.optimizer``.

DeepSpeed wraps the optimizer in a class chosen by stage and precision, and code written
for it asks which one it got (``isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)``
before reading stage-3 state). zerotrain has one wrapper, :class:`~zerotrain.optim.ZeroOptimizer`;
it carries the names of the DeepSpeed classes DeepSpeed would have used for the same config
(:func:`deepspeed_kinds`), and each class below answers ``isinstance`` from those names.
They cannot be constructed: zerotrain builds its optimizer through ``initialize``.
"""
from __future__ import annotations

from typing import Any

from ..config import ZeroTrainConfig
from ..errors import StateError, ZeroTrainError
from ..estimate import (estimate_zero2_model_states_mem_needs,
                       estimate_zero2_model_states_mem_needs_all_cold,
                       estimate_zero2_model_states_mem_needs_all_live,
                       estimate_zero3_model_states_mem_needs,
                       estimate_zero3_model_states_mem_needs_all_cold,
                       estimate_zero3_model_states_mem_needs_all_live)

__all__ = [
    "BF16_Optimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3",
    "FP16_Optimizer", "FP16_UnfusedOptimizer", "ZeROOptimizer", "ZeRORuntimeException",
    "deepspeed_kinds",
    "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
]


# DeepSpeed's ``runtime.zero.utils.ZeRORuntimeException``: what its ZeRO runtime raises on a
# setup it cannot run; zerotrain's errors all derive from ZeroTrainError, so code catching
# DeepSpeed's exception catches zerotrain's.
ZeRORuntimeException = ZeroTrainError


def deepspeed_kinds(config: ZeroTrainConfig) -> frozenset[str]:
    """The DeepSpeed optimizer classes DeepSpeed 0.19 wraps this config's optimizer in.

    Stage 3: ``DeepSpeedZeroOptimizer_Stage3``. Stage 1 with bf16 parameters, fp32 gradient
    accumulation and no optimizer offload: ``BF16_Optimizer``. Stages 1-2 otherwise:
    ``DeepSpeedZeroOptimizer``. Stage 0 in fp16 or bf16: ``FP16_Optimizer``; in fp32 the
    bare torch optimizer (no kind).
    """
    stage = config.zero_optimization.stage
    bf16, fp16 = config.bf16.enabled, config.fp16.enabled
    offload = config.zero_optimization.offload_optimizer
    offloaded = offload is not None and offload.device != "none"
    if stage == 3:
        return frozenset({"DeepSpeedZeroOptimizer_Stage3", "ZeROOptimizer"})
    if stage == 1 and bf16 and config.data_types.grad_accum_dtype == "fp32" and not offloaded:
        return frozenset({"BF16_Optimizer", "ZeROOptimizer"})
    if stage in (1, 2):
        return frozenset({"DeepSpeedZeroOptimizer", "ZeROOptimizer"})
    return frozenset({"FP16_Optimizer"}) if (bf16 or fp16) else frozenset()


class _Kind(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return cls.__name__ in getattr(obj, "deepspeed_kinds", ())


class ZeROOptimizer(metaclass=_Kind):
    """DeepSpeed's base of its ZeRO optimizers; ``isinstance`` only (see the module)."""

    def __new__(cls, *args: Any, **kwargs: Any):
        raise StateError(f"{cls.__name__} is DeepSpeed's optimizer wrapper; zerotrain builds "
                         "its optimizer in initialize(), use engine.optimizer")


class DeepSpeedZeroOptimizer(ZeROOptimizer):
    """Stages 1 and 2."""


class DeepSpeedZeroOptimizer_Stage3(ZeROOptimizer):  # noqa: N801 - DeepSpeed's name
    """Stage 3."""


class BF16_Optimizer(ZeROOptimizer):  # noqa: N801 - DeepSpeed's name
    """Stage 1, bf16 parameters, fp32 gradient accumulation."""


class FP16_Optimizer(ZeROOptimizer):  # noqa: N801 - DeepSpeed's name
    """Stage 0, fp16 or bf16."""


class FP16_UnfusedOptimizer(ZeROOptimizer):  # noqa: N801 - DeepSpeed's name
    """Stage 0 with an optimizer DeepSpeed cannot fuse; zerotrain's never is this one."""

