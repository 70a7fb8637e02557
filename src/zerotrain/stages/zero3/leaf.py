"""Leaf modules: DeepSpeed's ``set_z3_leaf_modules`` family, and its ``leaf_module`` config.

Note: leaf modules
    A leaf module is gathered whole, as one unit, when its forward starts, and released
    after its backward; nothing inside it is a unit of its own (``unit_specs.py``). So the
    gathers a rank makes do not depend on what runs inside it: a mixture-of-experts block
    whose router sends no token to some expert on one rank gathers exactly what every other
    rank gathers. Without the declaration each expert is its own unit, and ranks whose
    routing differs gather different units; stage 3 then stops with
    ``RankDivergenceError`` (Note "gather check" in ``wire.py``). The cost is memory: the
    whole leaf is gathered at once (the estimator counts the largest leaf as the gathered
    window).

    The flag lives on the module (``module._z3_leaf``), as in DeepSpeed 0.19, so a model
    flagged by Accelerate's plugin or by a script through ``deepspeed.utils`` is seen here
    too; stage 3 marks each parameter of a leaf with ``ds_z3_leaf_module`` (its leaf), which
    ``z3_leaf_parameter`` reads.
"""
from __future__ import annotations

import logging
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from torch import nn

from .ds_attrs import ds_module

logger = logging.getLogger(__name__)

# What DeepSpeed 0.19 flags by default (``zero_optimization.leaf_module.classes``).
DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)

ClassList = Union[Sequence[type], Sequence[str]]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf module."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(model: nn.Parameter) -> bool:
    """Whether a parameter belongs to a leaf module (stage 3 marks them)."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` flagged as leaves, in ``modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Flag (or unflag) one module."""
    ds_module(model)._z3_leaf = flag


def _qualified_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: nn.Module, wanted: Union[type, str]) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return type(module).__name__ == wanted or _qualified_name(module) == wanted


def _flag_classes(model: nn.Module, classes: ClassList, flag: bool,
                  raise_if_not_found: bool) -> List[nn.Module]:
    listed: list[Union[type, str]] = list(classes)
    bad = [c for c in listed if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be a list of classes or class names, "
                        f"got {bad!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in listed)]
    for m in found:
        ds_module(m)._z3_leaf = flag
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {listed} found in model "
                         f"{type(model).__name__}")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: ClassList,
                        raise_if_not_found: bool = True) -> List[nn.Module]:
    """Flag every module of ``model`` whose class is in ``leaf_module_classes`` (classes, or
    names: bare or fully qualified) as a leaf (Note: leaf modules). Returns the modules
    flagged; raises ValueError when none matches, unless ``raise_if_not_found`` is False.
    Call it before ``initialize``."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: ClassList,
                          raise_if_not_found: bool = True) -> List[nn.Module]:
    """Remove the leaf flag from the modules of these classes."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Sequence[str],
                                flag: bool = True, raise_if_not_found: bool = True
                                ) -> Tuple[List[nn.Module], List[str]]:
    """Flag the modules named (as in ``named_modules()``); returns them and the names that
    matched nothing (a ValueError instead when ``raise_if_not_found``)."""
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in module_names:
        module = by_name.get(name)
        if module is None:
            missing.append(name)
            continue
        ds_module(module)._z3_leaf = flag
        found.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Sequence[str],
                                  flag: bool = True, raise_if_not_found: bool = True
                                  ) -> Tuple[List[nn.Module], List[str]]:
    """Flag the modules whose ``named_modules()`` name ends with one of the suffixes;
    returns them (each once) and the suffixes that matched nothing."""
    by_name = dict(model.named_modules())
    found, missing, seen = [], [], set()
    for suffix in module_name_suffixes:
        matched = False
        for name, module in by_name.items():
            if name.endswith(suffix):
                ds_module(module)._z3_leaf = flag
                matched = True
                if id(module) not in seen:
                    seen.add(id(module))
                    found.append(module)
        if not matched:
            missing.append(suffix)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model "
                         f"{type(model).__name__}")
    return found, missing


def apply_leaf_module_config(model: nn.Module, leaf_cfg: Optional[dict]) -> List[nn.Module]:
    """Apply ``zero_optimization.leaf_module`` (``classes``, ``names``, ``name_suffixes``;
    DeepSpeed 0.19's defaults: the Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks) to
    ``model``; returns the modules flagged. Unknown names and suffixes a config asked for
    are logged, not raised, as DeepSpeed does."""
    leaf_cfg = dict(leaf_cfg or {})
    classes = _as_list(leaf_cfg.get("classes", DEFAULT_LEAF_MODULE_CLASSES))
    names = _as_list(leaf_cfg.get("names", ()))
    suffixes = _as_list(leaf_cfg.get("name_suffixes", ()))
    flagged: dict[int, nn.Module] = {}
    for m in set_z3_leaf_modules(model, classes, raise_if_not_found=False) if classes else []:
        flagged.setdefault(id(m), m)
    if names:
        found, missing = set_z3_leaf_modules_by_name(model, names, raise_if_not_found=False)
        flagged.update((id(m), m) for m in found)
        if missing:
            logger.warning("zero_optimization.leaf_module.names: no module named %s", missing)
    if suffixes:
        found, missing = set_z3_leaf_modules_by_suffix(model, suffixes,
                                                       raise_if_not_found=False)
        flagged.update((id(m), m) for m in found)
        if missing:
            logger.warning("zero_optimization.leaf_module.name_suffixes: no module name "
                           "ends with %s", missing)
    return list(flagged.values())


def _as_list(value: Union[str, Iterable[str]]) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]
