"""DeepSpeed's optimizer wrapper classes, for ``isinstance`` checks on ``engine.optimizer``.

DeepSpeed wraps the optimizer in a class chosen by stage and precision, and code written
for it asks which one it got (``isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)``
before reading stage-3 state). zerotrain has one wrapper, :class:`~zerotrain.optim.ZeroOptimizer`;
it carries the names of the DeepSpeed classes DeepSpeed would have used for the same config
(``stages.factory.deepspeed_kinds``, which chooses by stage), and each class below answers
``isinstance`` from those names.
They cannot be constructed: zerotrain builds its optimizer through ``initialize``.
"""
from __future__ import annotations

from typing import Any

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
    "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
]


# DeepSpeed's ``runtime.zero.utils.ZeRORuntimeException``: what its ZeRO runtime raises on a
# setup it cannot run; zerotrain's errors all derive from ZeroTrainError, so code catching
# DeepSpeed's exception catches zerotrain's.
ZeRORuntimeException = ZeroTrainError


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

