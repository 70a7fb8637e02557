"""Ψ_s for the estimate with tensor parallelism: the parameters of a model that AutoTP's
rules split, counted on the model built on the meta device with the planner's builder (the
estimate's formula takes the number; the model and the rules live above its row)."""
from __future__ import annotations

from typing import Any

from ..estimate.tensor_parallel import tp_heads

__all__ = ["split_of_model_spec", "split_params"]


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

    from .spec import StepSpec, build_model

    with torch.device("meta"):
        model = build_model(StepSpec(spec, dtype="fp32"))
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return total, split_params(model), tp_heads(model)
