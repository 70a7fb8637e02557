"""Partitioned parameters used by hand, outside a unit: ``zero.GatheredParameters``,
DeepSpeed's per-parameter methods (``all_gather``, ``partition``, ``ds_summary``),
``unpartition`` (a ``zero.Init`` model made whole for stages 0-2) and
``register_external_parameter``. ``zero_init.py`` partitions at construction and re-exports
these names."""
from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from ...comm import Communicator
from ...errors import StateError
from . import partition as P
from .ds_attrs import ZeroParamStatus, drop_chunk, ds_module, ds_param


def global_rank(comm: Communicator, group_rank: int) -> int:
    if comm.group is None:
        return group_rank
    return torch.distributed.get_global_rank(comm.group, group_rank)


class GatheredParameters:
    """Full parameters inside the block (``deepspeed.zero.GatheredParameters``).

    For partitioned (stage 3) parameters every rank must enter: each parameter is
    all-gathered, and on exit, when ``modifier_rank`` is given, that rank's values are
    broadcast and written back into every rank's shard (and fp32 master). Parameters that
    are not partitioned (stages 0-2) are left alone, so the same code runs at every stage.
    """

    def __init__(self, params: Union[torch.Tensor, Iterable[torch.Tensor]],
                 modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        given = [params] if isinstance(params, torch.Tensor) else list(params or [])
        unique = {id(p): p for p in given}
        self.params = [p for p in unique.values() if P.is_partitioned(p)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)
        self._gathered: list[torch.Tensor] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        self.comm = Communicator()
        for p in self.params:
            if p.numel() == ds_param(p).ds_numel:  # already whole (its unit is gathered)
                continue
            p.data = _gather_full(p, _shard_comm(p, self.comm), _compute_device(p))
            self._gathered.append(p)
        P.mark(self._gathered, ZeroParamStatus.AVAILABLE)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None and exc[0] is None:
            for p in self.params:
                full = p.data.to(self.comm.device).contiguous()
                self.comm.broadcast(full, src=global_rank(self.comm, self.modifier_rank))
                shard = _shard_comm(p, self.comm)
                chunk = P.chunk_of(full, shard.rank, shard.world_size)
                k = _frozen_index(p)
                ds = ds_param(p)
                if k is not None:   # int8 frozen chunk: quantized again (zero3/frozen.py)
                    frozen = ds.ds_unit.frozen
                    assert frozen is not None   # _frozen_index found p among its chunks
                    full = frozen.round_trip(k, full, shard.world_size)
                    frozen.store(k, chunk)
                else:
                    ds.ds_tensor.copy_(chunk)
                    master = getattr(p, "ds_master", None)
                    if master is not None:
                        master.copy_(chunk)
                p.data.copy_(full.view_as(p.data))   # the value every rank now decodes
                if getattr(p, "ds_unit", None) is not None:
                    ds.ds_unit.shards_changed()
        for p in self._gathered:
            p.data = P.empty_placeholder(p)
        P.mark(self._gathered, ZeroParamStatus.NOT_AVAILABLE)
        self._gathered.clear()


class _Gathered:
    """The handle ``all_gather_coalesced`` returns: the gathers are done when it returns
    (they are synchronous here), so ``wait`` has nothing left to wait for."""

    def wait(self, handle_dependency: bool = True) -> None:
        """Nothing in flight (see the class)."""


def all_gather_coalesced(params: Iterable[nn.Parameter], safe_mode: bool = False,
                         quantize: bool = False) -> _Gathered:
    """DeepSpeed's ``param.all_gather_coalesced(params)``: every released partitioned
    parameter of ``params`` gets its full value in ``.data`` and stays whole until
    ``param.partition()`` (or its unit's next release). Collective: every rank passes the
    same parameters. ``safe_mode`` and ``quantize`` are DeepSpeed's options with nothing
    to change here (the chunks go over as they are kept)."""
    comm = Communicator()
    gathered = []
    for p in {id(p): p for p in params}.values():
        if not P.is_partitioned(p) or p.numel() == ds_param(p).ds_numel:
            continue
        p.data = _gather_full(p, _shard_comm(p, comm), _compute_device(p))
        gathered.append(p)
    P.mark(gathered, ZeroParamStatus.AVAILABLE)
    return _Gathered()


def release(params: Iterable[nn.Parameter]) -> None:
    """DeepSpeed's ``param.partition(params)``: drop the full value of each gathered
    parameter (its chunk stays the value; a change made to the full value is not kept:
    write through ``zero.GatheredParameters(..., modifier_rank=...)``)."""
    released = [p for p in params if P.is_partitioned(p)
                and p.numel() == ds_param(p).ds_numel and ds_param(p).ds_numel > 0]
    for p in released:
        p.data = P.empty_placeholder(p)
    P.mark(released, ZeroParamStatus.NOT_AVAILABLE)


def attach_param_methods(p: nn.Parameter) -> None:
    """Give a partitioned parameter DeepSpeed's per-parameter methods: ``all_gather()``,
    ``all_gather_coalesced(params)``, ``partition(param_list=None)`` and ``ds_summary()``,
    and its usage records as they stand before a stage uses it (no module is using it, it
    is no external parameter: Note "usage records" in ``usage.py``). The methods hold the
    parameter weakly: a parameter keeping itself alive through its own attributes would
    wait for the cycle collector to free its memory."""
    ref = weakref.ref(p)
    ds = ds_param(p)
    ds.all_gather = functools.partial(_gather_one, ref)
    ds.all_gather_coalesced = all_gather_coalesced
    ds.partition = functools.partial(_release_one, ref)
    ds.ds_summary = functools.partial(_summary, ref)
    if not hasattr(p, "ds_active_sub_modules"):
        ds.ds_active_sub_modules = set()
    if not hasattr(p, "is_external_param"):
        ds.is_external_param = False


def _summary(ref: "weakref.ref[nn.Parameter]", use_debug_name: bool = False) -> dict:
    """DeepSpeed's ``param.ds_summary()``: what error messages print about a parameter."""
    p = ref()
    # reached through the parameter; a method kept past it fails here (before: on None.ds_id)
    assert p is not None
    ds = ds_param(p)
    ds_tensor = getattr(p, "ds_tensor", None)
    return {"id": ds.ds_id, "status": ds.ds_status.name, "numel": p.numel(),
            "ds_numel": ds.ds_numel, "shape": tuple(p.shape), "ds_shape": tuple(ds.ds_shape),
            "requires_grad": p.requires_grad,
            "grad_shape": tuple(p.grad.shape) if p.grad is not None else None,
            "persist": bool(getattr(p, "ds_persist", False)),
            "active_sub_modules": ds.ds_active_sub_modules,
            "ds_tensor.shape": ds_tensor.shape if ds_tensor is not None else None}


def _gather_one(ref: "weakref.ref[nn.Parameter]",
                param_list: Optional[Iterable[nn.Parameter]] = None,
                **_options: Any) -> _Gathered:
    return all_gather_coalesced(_held(ref) if param_list is None else param_list)


def _release_one(ref: "weakref.ref[nn.Parameter]",
                 param_list: Optional[Iterable[nn.Parameter]] = None, **_options: Any) -> None:
    release(_held(ref) if param_list is None else param_list)


def _held(ref: "weakref.ref[nn.Parameter]") -> list[nn.Parameter]:
    """The parameter whose method runs, or nothing once it is gone (a method kept past
    its parameter gathers and releases nothing)."""
    p = ref()
    return [] if p is None else [p]


def unpartition(params: Iterable[nn.Parameter], comm: Communicator) -> int:
    """Give parameters partitioned by ``zero.Init`` their full values back, for good.

    Stages 0-2 train full parameters: a model built under ``zero.Init`` and then handed to
    one of them (a script whose config moved from stage 3 to stage 2) gets the values plain
    construction would have given. Collective over ``comm`` (every rank, same order);
    returns how many parameters were made whole."""
    whole = 0
    for p in params:
        if not P.is_partitioned(p):
            continue
        ds = ds_param(p)
        if ds.ds_tensor.numel() != P.chunk_numel(ds.ds_numel, comm.world_size):
            raise StateError(
                f"a parameter of shape {tuple(ds.ds_shape)} was partitioned by zero.Init over "
                f"a group other than the {comm.world_size} data-parallel ranks: build the "
                "model outside zero.Init to train it at stages 0-2")
        p.data = _gather_full(p, comm, ds.ds_tensor.device)
        drop_chunk(p)
        ds.ds_status = ZeroParamStatus.AVAILABLE
        whole += 1
    return whole


def _frozen_index(p: torch.Tensor) -> Optional[int]:
    """``p``'s place among its unit's int8 frozen chunks, or None."""
    unit = getattr(p, "ds_unit", None)
    return unit.frozen_index(p) if unit is not None else None


def _gather_full(p: torch.Tensor, comm: Communicator, device: torch.device) -> torch.Tensor:
    """A partitioned parameter's full value on ``device``, all-gathered from every rank's
    chunk over ``comm`` (collective; offloaded chunks live on the host)."""
    chunk = _chunk_values(p).to(comm.device).contiguous()
    out = torch.empty(comm.world_size * chunk.numel(), dtype=chunk.dtype, device=chunk.device)
    comm.all_gather(out, chunk)
    return P.fill_full(p, out).to(device=device, dtype=p.dtype).clone()


def _chunk_values(p: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of ``p`` in its dtype (decoded when kept as int8)."""
    k = _frozen_index(p)
    if k is None:
        return ds_param(p).ds_tensor
    frozen = ds_param(p).ds_unit.frozen
    assert frozen is not None   # _frozen_index found p among its chunks
    return frozen.values(k, p.dtype)


def _shard_comm(p: torch.Tensor, world: Communicator) -> Communicator:
    """The group a parameter's chunks are spread over: its unit's (MiCS: a shard group)."""
    unit = getattr(p, "ds_unit", None)
    return unit.comm if unit is not None else world


def _compute_device(p: torch.Tensor) -> torch.device:
    """Where a partitioned parameter is used: its unit's device once a stage owns it."""
    unit = getattr(p, "ds_unit", None)
    return unit.device if unit is not None else ds_param(p).ds_tensor.device


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` owned by another module.

    Must be called before ``initialize``; tied parameters (the same Parameter registered on
    two modules) are found without it. It also shows in DeepSpeed's registry,
    ``module._external_params`` (Note "usage records" in ``usage.py``).
    """
    registry = getattr(module, "_external_params", None)
    if not isinstance(registry, dict):
        registry = ds_module(module)._external_params = {}
    registry[id(parameter)] = parameter
    external = getattr(module, "_zerotrain_external_params", None)
    if external is None:
        external = []
        ds_module(module)._zerotrain_external_params = external
    if not any(p is parameter for p in external):
        external.append(parameter)
