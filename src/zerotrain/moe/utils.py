"""DeepSpeed's mixture-of-experts helpers over parameters and optimizer groups.

An expert's parameter is marked ``allreduce = False`` with a ``group_name``
(``moe/experts.py``). DeepSpeed's optimizer wants such parameters in groups of their own
(``moe: True``, named after the expert group), because with expert parallelism they are
reduced over a different process group. At ``ep_size`` 1 that group is the data-parallel
group, so zerotrain's stages reduce them like any other parameter; the groups still
split as DeepSpeed splits them, so optimizer state and learning-rate schedules line up.
"""
from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn

from .layer import MoE

ParamGroups = Union[dict, tuple, list]

__all__ = ["configure_moe_param_groups", "has_moe_layers", "is_moe_param",
           "is_moe_param_group", "split_params_grads_into_shared_and_expert_params",
           "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]


def has_moe_layers(module: nn.Module) -> tuple[bool, int]:
    """Whether ``module`` holds an :class:`MoE` layer, and the first one's expert count."""
    for sub in module.modules():
        if isinstance(sub, MoE):
            return True, sub.num_experts
    return False, 0


def is_moe_param(param: Any) -> bool:
    """DeepSpeed marks an expert's parameter ``allreduce=False``."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict) -> bool:
    return param_group.get("moe", False)


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """``(shared, expert)`` parameters, each in the given order."""
    params = list(params)
    return ([p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)])


def split_params_grads_into_shared_and_expert_params(group) -> tuple[list, list]:
    """``(shared, expert)`` gradients (in each parameter's dtype) of the parameters that
    have one."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def _as_list(param_groups: ParamGroups) -> list[dict]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, tuple):
        return list(param_groups)
    if isinstance(param_groups, list):
        return param_groups
    raise ValueError(f"Unknown param group type of {type(param_groups)}")


def _chunks(params: list, max_group_size: Union[int, float]) -> list[list]:
    """``params`` in order, cut so that no chunk exceeds ``max_group_size`` elements
    (a parameter larger than that alone in its chunk)."""
    chunks: list[list] = [[]]
    size = 0
    for p in params:
        numel = getattr(p, "ds_numel", None) or p.numel()
        if chunks[-1] and size + numel > max_group_size:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += numel
    return [c for c in chunks if c]


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: ParamGroups, max_group_size: Union[int, float] = 178956971) -> list[dict]:
    """DeepSpeed's split: each group keeps its non-expert parameters, and its expert
    parameters move to new groups appended after all the given ones, one per (group, expert
    group name) in first-seen order, each a copy of the group's options with ``name`` the
    expert group's name (``ep_size_1``) and ``moe: True``, cut into pieces of at most
    ``max_group_size`` elements (``None``: uncut). The given groups are changed in place
    and need a ``name`` when they hold expert parameters."""
    param_groups = _as_list(param_groups)
    for group in param_groups:
        group["params"] = list(group["params"])
    names = list(dict.fromkeys(p.group_name for g in param_groups for p in g["params"]
                               if is_moe_param(p)))
    if not names:
        return param_groups
    added: list[dict] = []
    for group in param_groups:
        experts = [p for p in group["params"] if is_moe_param(p)]
        group["params"] = [p for p in group["params"] if not is_moe_param(p)]
        for name in names:
            params = [p for p in experts if p.group_name == name]
            base = {**group, "name": name, "moe": True}
            pieces = [params] if max_group_size is None else _chunks(params, max_group_size)
            added.extend({**base, "params": piece} for piece in pieces)
    param_groups.extend(added)
    return param_groups


def configure_moe_param_groups(model_parameters: list) -> list[dict]:
    """The groups DeepSpeed's engine gives its optimizer for a model with MoE layers: a
    list of parameters becomes ``dense-params`` plus the expert groups; groups without any
    ``moe`` key are split; groups that already have one are kept."""
    if not isinstance(model_parameters, list):
        raise TypeError("model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be "
                            f"an iterable of Tensors or dicts, but got {type(p)}")
    if model_parameters and isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"})
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
