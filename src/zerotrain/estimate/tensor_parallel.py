"""Tensor parallelism in the estimate: which of a model's parameters AutoTP splits, and the
checks ``initialize`` would make of a tensor-parallel size, made before any work.

Why a module of its own: the formula (``states.py``, Note "tensor parallelism") needs Ψ_s,
the parameters in split layers, and that comes from the same rules the engine applies
(``tp/rules.py``) to the model built on the meta device, never from a guess by family.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["TP_HEAD_KEYS", "check_tp_size", "split_params", "tp_heads"]

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


def split_params(model: Any, partition_config: Any = None) -> int:
    """Ψ_s: the parameter elements of ``model`` that AutoTP's rules split (the weights of
    the split linear layers, and the biases of column-parallel ones; a row-parallel bias is
    added once, whole on every rank). A parameter shared by several modules counts once."""
    from torch import nn

    from ..tp.rules import Rules

    rules = Rules(partition_config)
    counted: set[int] = set()
    total = 0
    for name, module in model.named_modules():
        rule = rules.rule_for(name) if name else None
        conv1d = type(module).__name__ == "Conv1D" and hasattr(module, "nf")
        if rule is None or not (isinstance(module, nn.Linear) or conv1d):
            continue
        split = [module.weight] + ([module.bias] if rule.kind == "column" else [])
        for param in split:
            if param is not None and id(param) not in counted:
                counted.add(id(param))
                total += param.numel()
    return total


def split_of_model_spec(spec: str) -> tuple[int, int, dict[str, int]]:
    """(Ψ, Ψ_s, head counts) of ``--model`` (a config.json, its folder or module:callable),
    built on the meta device (nothing allocated) with the planner's builder."""
    import torch

    from ..planner.spec import StepSpec, build_model

    with torch.device("meta"):
        model = build_model(StepSpec(spec, dtype="fp32"))
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return total, split_params(model), tp_heads(model)
