"""DeepSpeed's mixture-of-experts helpers: importable; unusable (``unsupported.py``) except
``split_params_into_different_moe_groups_for_optimizer``, which scripts call on every model
(it is how DeepSpeed's MoE tutorial builds its optimizer groups) and which has nothing to do
when no parameter is an expert's."""
from __future__ import annotations

from typing import Any, Union

from ..unsupported import UnsupportedFeatureError, stub_getattr

__getattr__ = stub_getattr(__name__, "mixture of experts (deepspeed.moe)")

ParamGroups = Union[dict, tuple, list]


def is_moe_param(param: Any) -> bool:
    """DeepSpeed marks an expert's parameter ``allreduce=False``."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: ParamGroups, max_group_size: Union[int, float] = 178956971) -> list[dict]:
    """The groups as a list, each with its own list of parameters, as DeepSpeed returns them
    when no parameter is an expert's; expert parameters are refused (zerotrain has no MoE)."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        group["params"] = list(group["params"])
        if any(is_moe_param(p) for p in group["params"]):
            raise UnsupportedFeatureError(
                f"parameter group {group.get('name', '?')!r} holds expert (MoE) parameters; "
                "zerotrain does not implement mixture of experts")
    return param_groups
