"""The attributes stage 3 sets on torch's parameters and modules, in DeepSpeed's names
(``param.ds_tensor``, ``module.ds_id``...), declared with their types in one place.

Why a module of its own: code written for DeepSpeed reads these attributes, so they live on
``nn.Parameter`` and ``nn.Module`` objects whose classes do not declare them, and a type
checker cannot see what they hold. :func:`ds_param` and :func:`ds_module` return the object
they are given, unchanged (``typing.cast``: no copy, no check, no wrapper), typed as
:class:`DsParameter` / :class:`DsModule`, which declare every attribute, so a misspelled name
or a value of the wrong type is a type error rather than a ``# type: ignore``. Neither class
is ever instantiated; an attribute exists only once the code that owns it has set it
(``getattr(p, "ds_unit", None)`` stays the way to ask whether it has).

The modules that set the attributes import this one, so it imports none of them: what code
reaches through ``param.ds_unit`` is declared here as protocols (:class:`UnitView`), which
mypy checks ``Unit`` against where ``unit.py`` sets it, and ``ds_status``'s values live here.
"""
from __future__ import annotations

import enum
from typing import Any, Callable, Iterable, Optional, Protocol, cast

import torch
from torch import nn


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``ds_status`` values: whether ``param.data`` holds the full value."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class FrozenView(Protocol):
    """What ``param.ds_unit.frozen`` offers (``frozen.QuantizedSlice``: int8 chunks)."""

    def store(self, k: int, chunk: torch.Tensor) -> None: ...

    def values(self, k: int, dtype: torch.dtype = ...) -> torch.Tensor: ...

    def round_trip(self, k: int, full: torch.Tensor, world: int) -> torch.Tensor: ...


class SpecView(Protocol):
    """What ``param.ds_unit.spec`` offers (``unit_specs.UnitSpec``)."""

    @property
    def index(self) -> int: ...

    @property
    def persistent(self) -> bool: ...


class UnitView(Protocol):
    """What code that finds a parameter's unit through ``param.ds_unit`` uses of it
    (``unit.Unit``, which owns the parameter once a stage does)."""

    @property
    def spec(self) -> SpecView: ...

    @property
    def frozen(self) -> Optional[FrozenView]: ...

    def shards_changed(self) -> None: ...


class DsParameter(nn.Parameter):
    """A parameter as stage 3 and ``zero.Init`` leave it (types only; see the module)."""

    # partition.py (Note "parameter chunks"): the full parameter while ``.data`` is empty
    ds_shape: torch.Size
    ds_numel: int
    ds_tensor: torch.Tensor   # this rank's chunk; None again once made whole (unpartition)
    ds_id: int
    ds_status: ZeroParamStatus
    # unit.py: the unit that owns the parameter, its fp32 master chunk (None for an int8
    # frozen one) and whether the unit stays gathered between uses
    ds_unit: UnitView
    ds_master: Optional[torch.Tensor]
    ds_persist: bool
    # usage.py (Note "usage records"): the ds_id of every module using the unit now
    ds_active_sub_modules: set[int]
    is_external_param: bool
    # unit_specs.py: the leaf module the parameter belongs to (leaf.py)
    ds_z3_leaf_module: nn.Module
    # gathered.py: DeepSpeed's per-parameter methods
    all_gather: Callable[..., Any]
    all_gather_coalesced: Callable[..., Any]
    partition: Callable[..., None]
    ds_summary: Callable[..., dict]


class DsModule(nn.Module):
    """A module as stage 3 leaves it (types only; see the module)."""

    # usage.py (Note "usage records")
    ds_id: int
    ds_recompute_parameters: set[nn.Parameter]
    ds_external_parameters: Callable[[], Iterable[tuple[int, nn.Parameter]]]   # usage.py's
    _external_params: dict[int, nn.Parameter]
    # gathered.py: parameters declared with zero.register_external_parameter
    _zerotrain_external_params: list[nn.Parameter]
    # leaf.py (Note "leaf modules"): gathered and released as one unit
    _z3_leaf: bool
    # stage_hooks.py: its state_dict() of partitioned parameters was warned about once
    _zerotrain_warned_state_dict: bool


def ds_param(param: torch.Tensor) -> DsParameter:
    """``param`` itself, typed with the attributes stage 3 gives it."""
    return cast(DsParameter, param)


def ds_module(module: nn.Module) -> DsModule:
    """``module`` itself, typed with the attributes stage 3 gives it."""
    return cast(DsModule, module)


def drop_chunk(param: torch.Tensor) -> None:
    """``param.ds_tensor`` becomes None: the parameter holds its full value for good and
    ``partition.is_partitioned`` is False from now on (``gathered.unpartition``)."""
    setattr(param, "ds_tensor", None)   # the one None ds_tensor: declared as a tensor above
