"""Tensor parallelism in the estimate: which of a model's parameters AutoTP splits, and the
checks ``initialize`` would make of a tensor-parallel size, made before any work.

Why a module of its own: the formula (``states.py``, Note "tensor parallelism") needs Ψ_s,
the parameters in split layers, and that comes from the same rules the engine applies
(``tp/rules.py``) to the model built on the meta device, never from a guess by family
(``planner/tp_split.py`` builds the model and counts them, a row above this one).
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["TP_HEAD_KEYS", "check_tp_size", "tp_heads"]

# the model config's head counts a tensor-parallel size must divide (as ``tp/apply.py``)
TP_HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "n_head")


def check_tp_size(tp: int, world: int, heads: Optional[dict[str, int]] = None) -> None:
    """ValueError, one line naming both numbers, when ``tp`` cannot run on ``world`` ranks
    or on a model with these head counts (``initialize`` refuses the same)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor-parallel size {tp!r} must be a whole number of at least 1")
    if world % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the {world} GPUs; the "
                         f"ranks form a {tp} x (GPUs / {tp}) mesh")
    for key, value in (heads or {}).items():
        if value % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the model's {key} "
                             f"({value}): each rank must hold whole attention heads")


def tp_heads(model: Any) -> dict[str, int]:
    """The head counts of ``model.config`` (a transformers model) that T must divide."""
    config = getattr(model, "config", None)
    found = {key: getattr(config, key, None) for key in TP_HEAD_KEYS}
    return {k: v for k, v in found.items() if isinstance(v, int) and not isinstance(v, bool)}
