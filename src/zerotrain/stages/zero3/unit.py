"""A unit at run time: its shards, and gathering/releasing its full parameters.

Note: unit tensors
    ``master``   fp32, this rank's chunks of all the unit's parameters, laid out as one
                 ``FlatLayout`` per optimizer group side by side (``column`` offsets); the
                 optimizer steps views of it, one per group.
    ``frozen``   with ``zero_quantized_nontrainable_weights``, the chunks of the parameters
                 no optimizer steps, as int8 blocks (``frozen.py``); those parameters then
                 have no columns in ``master`` and ``shard``, and ``slices`` leaves them out.
    ``shard``    the same chunks in the parameter dtype; the same tensor as ``master`` in
                 fp32 training without offload. This is what is all-gathered (copied to the
                 device first when ``offload_param`` keeps it in host memory or in a file).
    ``full``     the unit's full parameters, one flat buffer in the parameter dtype: a
                 *segment* per parameter, its values first, then room for the padding the
                 gathers write (``wire.padded_numel``). The gathers land there directly
                 (Note "gathering in place" in ``wire.py``). The tensor lives as long as
                 the unit; its storage has bytes only while the unit is being gathered or
                 is gathered (Note: freed storage). Each parameter's ``.data`` is a view of
                 its segment while gathered, and an empty tensor otherwise
                 (``partition.py``).

    States move RELEASED -> GATHERING (an all-gather in flight) -> GATHERED -> RELEASED; each
    transition asserts where it starts. Persistent units are gathered once and stay GATHERED.

Note: freed storage
    Autograd keeps what a forward saves for backward: often a view of a parameter (``addmm``
    saves ``weight.t()``), which holds the storage it views. Were each gather a new buffer,
    every unit's full parameters would stay alive from its forward to its backward, the
    whole model at once. So a unit owns one ``full`` tensor for its lifetime: releasing it
    resizes its storage to zero bytes (the saved views stay valid objects over an empty
    storage), and gathering it again, before its backward uses those views, resizes the
    same storage back and writes the full values into it. The saved views then read the
    right values again. This is FSDP2's scheme (``_fsdp_param.py``, ``free_storage`` and
    ``alloc_storage``); it makes what autograd saves cost nothing between a unit's forward
    and its backward. Nothing may read a saved view while its unit is released: the hooks
    (``scheduler.py``) gather a unit before its backward starts and release it only once every
    use in backward is done.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from ...comm import Communicator
from ...errors import StateError
from ...core.flat import FlatLayout
from ...offload import Storage
from ...core.precision import PrecisionPolicy
from . import partition as P
from .ds_attrs import ZeroParamStatus, ds_param
from .frozen import QuantizedSlice
from .unit_specs import UnitSpec
from .wire import NO_BUCKET_LIMIT, Gatherings, UnitWire
from .zero_init import attach_param_methods


class UnitState(enum.Enum):
    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass(slots=True)
class GroupSlice:
    """The unit's parameters of one optimizer group (``group`` None: frozen)."""

    group: Optional[int]
    indices: list[int]        # positions in the unit's parameter list
    layout: FlatLayout
    column: int               # where this layout's chunks start in the unit's shard


class Unit:
    """One unit of stage 3 on this rank: a group of parameters gathered and released
    together, with its shards (``master``, ``shard``, ``frozen``) and its ``full`` buffer
    (Note: unit tensors).

    It moves RELEASED -> GATHERING -> GATHERED -> RELEASED and counts its holders; when to
    move is the :class:`~zerotrain.stages.zero3.scheduler.UnitScheduler`'s call, how the
    bytes travel is :mod:`~zerotrain.stages.zero3.wire`'s. Its gradients leave through the
    stage's buckets, one column of ``master`` per optimizer group.
    """

    def __init__(self, spec: UnitSpec, *, comm: Communicator, policy: PrecisionPolicy,
                 group_of: dict[int, Optional[int]], device: torch.device,
                 storage: Storage, shard_storage: Storage,
                 wire: Optional[UnitWire] = None, quantize_frozen: bool = False) -> None:
        self.spec = spec
        self.comm = comm
        self.wire = wire or UnitWire(comm)   # how full values are gathered (wire.py)
        self.policy = policy
        self.device = device
        self.slices, apart = self._group_slices(group_of, frozen_apart=quantize_frozen)
        self.frozen: Optional[QuantizedSlice] = None
        if apart is not None:
            self.frozen = QuantizedSlice(apart, storage=shard_storage, dtype=policy.param_dtype)
        self.shard_numel = sum(s.layout.shard_numel for s in self.slices)
        self.numel = spec.numel
        self.master = self._initial_master(storage)
        self._send = shard_storage.send   # host shards go up on a side stream
        if not policy.has_master_copy and storage.can_alias() and shard_storage.can_alias():
            self.shard = self.master
        else:  # masters and shards live apart (16-bit training, or offload)
            self.shard = shard_storage.zeros(self.shard_numel, policy.param_dtype)
            self.shard.copy_(self.master)
        self.state = UnitState.RELEASED
        self._holders = 0   # Note: holders in scheduler.py
        self._pending: Optional[Gatherings] = None   # the gather in flight
        for p in spec.params:  # the unit's shard is the source of truth from now on
            ds = ds_param(p)
            ds.ds_shape, ds.ds_numel = P.full_shape(p), P.full_numel(p)
            ds.ds_persist = spec.persistent   # DeepSpeed's name: stays gathered between uses
            p.data = P.empty_placeholder(p)
        P.mark(spec.params, ZeroParamStatus.NOT_AVAILABLE)
        self.full = torch.empty(sum(self._segment_numels()), dtype=self.shard.dtype,
                                device=device)
        self.segments, self.views = self._param_views()   # made while the storage has bytes
        self._free_full()                   # Note: freed storage
        self._attach()
        if spec.persistent:
            self.start_gather()
            self.finish_gather()

    # ------------------------------------------------------------------ set-up
    def _group_slices(self, group_of: dict[int, Optional[int]], *, frozen_apart: bool
                      ) -> tuple[list[GroupSlice], Optional[GroupSlice]]:
        """The slices kept in ``master``/``shard``, columns side by side; with
        ``frozen_apart`` the frozen slice is returned apart (column 0 of its own)."""
        by_group: dict[Optional[int], list[int]] = {}
        for i, p in enumerate(self.spec.params):
            by_group.setdefault(group_of.get(id(p)), []).append(i)
        slices, column, apart = [], 0, None
        for group, indices in by_group.items():
            layout = FlatLayout([P.full_numel(self.spec.params[i]) for i in indices],
                                world=self.comm.world_size, bucket_numel=NO_BUCKET_LIMIT)
            if group is None and frozen_apart:
                apart = GroupSlice(group, indices, layout, 0)
                continue
            slices.append(GroupSlice(group, indices, layout, column))
            column += layout.shard_numel
        return slices, apart

    def _initial_master(self, storage: Storage) -> torch.Tensor:
        """fp32 chunks, from zero.Init's chunks or from the full parameters."""
        master = storage.zeros(self.shard_numel, self.policy.master_dtype)
        for s in self.slices:
            for slot, i in zip(s.layout.slots, s.indices):
                where = s.layout.shard_slice(slot)
                master[s.column + where.start: s.column + where.stop] = \
                    self._initial_chunk(i, slot.chunk).to(master)
        if self.frozen is not None:   # quantized once; the full-precision chunk is dropped
            for k, (slot, i) in enumerate(zip(self.frozen.slice.layout.slots,
                                              self.frozen.indices)):
                self.frozen.store(k, self._initial_chunk(i, slot.chunk))
        return master

    def _initial_chunk(self, i: int, numel: int) -> torch.Tensor:
        """This rank's chunk of parameter ``i``: zero.Init's, or cut from the parameter."""
        rank, world = self.comm.rank, self.comm.world_size
        p = self.spec.params[i]
        if P.is_partitioned(p) and p.numel() != 0:
            raise ValueError(
                f"parameter {self.spec.names[i]!r} was partitioned by zero.Init and then "
                "given a full .data outside zero.GatheredParameters; that value would "
                "be lost: write it inside zero.GatheredParameters(params, "
                "modifier_rank=0) or with an in-place operation")
        chunk = ds_param(p).ds_tensor if P.is_partitioned(p) else P.chunk_of(p.data, rank, world)
        if chunk.numel() != numel:
            raise StateError(
                f"a parameter of unit {self.spec.name or '<root>'!r} was partitioned "
                f"by zero.Init into chunks of {chunk.numel()} elements, but stage 3 "
                f"shards it over {world} ranks (mics_shard_size): build the model "
                "outside zero.Init")
        return chunk

    def _attach(self) -> None:
        """DeepSpeed-style attributes; ``ds_tensor`` is a view of this rank's chunk."""
        for s in self.slices:
            for slot, i in zip(s.layout.slots, s.indices):
                where = s.layout.shard_slice(slot)
                p = self.spec.params[i]
                ds = ds_param(p)
                ds.ds_tensor = P.chunk_view(   # Note "writes through ds_tensor" in partition.py
                    self.shard[s.column + where.start: s.column + where.stop],
                    self.spec.names[i], self._note_rebind)
                ds.ds_master = self.master[s.column + where.start: s.column + where.stop]
                ds.ds_unit = self
                attach_param_methods(p)
        if self.frozen is not None:   # DeepSpeed's ds_tensor is the int8 chunk here too
            for k, i in enumerate(self.frozen.indices):
                p = self.spec.params[i]
                ds = ds_param(p)
                ds.ds_tensor = self.frozen.row(k)
                ds.ds_master = None
                ds.ds_unit = self
                attach_param_methods(p)
        self._shard_version = self.shard._version   # the shard follows the master now
        self._rebound = False   # a ds_tensor's .data was assigned since take_rebinds
        # (parameter index, offset in the shard, numel) of each ds_tensor viewing the shard
        self._chunks = [(i, s.column + where.start, where.stop - where.start)
                        for s in self.slices for slot, i in zip(s.layout.slots, s.indices)
                        for where in (s.layout.shard_slice(slot),)]

    def frozen_index(self, p: torch.Tensor) -> Optional[int]:
        """``p``'s position in the quantized frozen slice, or None when it has a shard."""
        if self.frozen is None:
            return None
        for k, i in enumerate(self.frozen.indices):
            if self.spec.params[i] is p:
                return k
        return None

    def frozen_on_device(self):
        """The packed frozen chunks on the gather device, and the context to launch their
        collective in (as ``shard_on_device``)."""
        return self._send(self.frozen.packed, self.device)

    def master_view(self, s: GroupSlice) -> torch.Tensor:
        return self.master[s.column: s.column + s.layout.shard_numel]

    # ------------------------------------------------------------------ holders
    def hold(self) -> None:
        """One more holder keeps the unit gathered (Note: holders in scheduler.py)."""
        self._holders += 1

    @property
    def held(self) -> bool:
        return self._holders > 0

    def let_go(self) -> bool:
        """One holder fewer; True when none is left, so the caller releases the unit."""
        self._holders = max(0, self._holders - 1)
        return self._holders == 0

    def drop_holders(self) -> None:
        """Forget every holder (backward ended: whatever is still gathered is released)."""
        self._holders = 0

    # ------------------------------------------------------------------ gather / release
    def start_gather(self) -> None:
        """Launch the all-gather of the full parameters (collective, asynchronous)."""
        self._expect(UnitState.RELEASED)
        if not self.spec.params:  # a unit that only gathers its dependencies
            self.state = UnitState.GATHERED
            return
        self.take_rebinds()   # a rebound ds_tensor is this gather's value
        self._alloc_full()   # the gather writes into it (Note: freed storage)
        try:
            self._pending = self.wire.start(self, label=f"unit {self.spec.name or '<root>'}")
        except BaseException:
            self._free_full()
            raise
        P.mark(self.spec.params, ZeroParamStatus.INFLIGHT)
        self.state = UnitState.GATHERING

    def shard_on_device(self):
        """This rank's shard on the gather device, and the context to launch its collective
        in (host shards go up on a side stream: Note "copy streams" in
        offload/transfers.py)."""
        return self._send(self.shard, self.device)

    def finish_gather(self) -> None:
        """Wait for the gather, which wrote the full values into ``full`` (Note "gathering
        in place" in ``wire.py``), and point every parameter at its view of it."""
        if self.state is UnitState.GATHERED:
            return
        self._expect(UnitState.GATHERING)
        assert self._pending is not None   # GATHERING: start_gather() set it
        self._pending.wait()   # a failed gather stays pending: waiting again raises again
        self._pending = None
        self.wire.gathered(self, self.views)
        for p, view in zip(self.spec.params, self.views):
            p.data = view
        P.mark(self.spec.params, ZeroParamStatus.AVAILABLE)
        self.state = UnitState.GATHERED

    def release(self, *, persistent_too: bool = False) -> None:
        """Drop the full parameters: their ``.data`` becomes empty and ``full``'s storage
        is freed even where autograd saved views of it (Note: freed storage); shards stay.
        A persistent unit is released only when the stage closes (``persistent_too``)."""
        if self.spec.persistent and not persistent_too:
            raise StateError(f"unit {self.spec.name!r} is persistent and cannot be released")
        if self.state is UnitState.GATHERING:
            self.finish_gather()
        if self.state is UnitState.RELEASED:
            return
        for p in self.spec.params:
            p.data = P.empty_placeholder(p)
        P.mark(self.spec.params, ZeroParamStatus.NOT_AVAILABLE)
        self._free_full()
        self.state = UnitState.RELEASED

    def _free_full(self) -> None:
        self.full.untyped_storage().resize_(0)

    def _alloc_full(self) -> None:
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.full.numel() * self.full.element_size())

    def _segment_numels(self) -> list[int]:
        return [self.wire.padded_numel(ds_param(p).ds_numel) for p in self.spec.params]

    def _param_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each parameter's segment of ``full`` and its view (the segment's first
        ``numel`` elements, shaped), made once: the views autograd saves and the segments
        later gathers write into share the one storage."""
        segments, views, offset = [], [], 0
        for p, numel in zip(self.spec.params, self._segment_numels()):
            segment = self.full[offset: offset + numel]
            segments.append(segment)
            ds = ds_param(p)
            views.append(segment[: ds.ds_numel].view(ds.ds_shape))
            offset += numel
        return segments, views

    def refresh_slice(self, s: GroupSlice, master: torch.Tensor) -> None:
        """After an optimizer step: the parameter-dtype shard of slice ``s`` follows
        ``master`` (its fp32 values, wherever they are resident)."""
        if self.shard is not self.master:
            self.shard[s.column: s.column + s.layout.shard_numel].copy_(master)
        self.shards_changed()

    def shards_changed(self) -> None:
        """The shards were written by zerotrain (an optimizer step, ``GatheredParameters``)
        and follow the master."""
        self.wire.shards_changed(self)
        self._shard_version = self.shard._version

    # ------------------------------------------------------------------ ds_tensor writes
    def _note_rebind(self) -> None:
        """A ``ds_tensor`` of this unit had its ``.data`` assigned (by a script, or by
        ``offload_states`` moving the shard): look at them before the next use."""
        self._rebound = True

    def take_rebinds(self) -> bool:
        """Copy each rebound ``ds_tensor`` into the shard and point it back at its chunk;
        True if any was (Note "writes through ds_tensor" in partition.py). Local."""
        if not self._rebound:
            return False
        self._rebound = False
        taken, base = False, self.shard.data_ptr()
        size = self.shard.element_size()
        for i, start, numel in self._chunks:
            current = ds_param(self.spec.params[i]).ds_tensor
            if (type(current) is P.ChunkTensor and current.numel() == numel
                    and (numel == 0 or current.data_ptr() == base + start * size)):
                continue   # still this chunk of the shard (the cheap check, every gather)
            own = self.shard[start: start + numel]
            taken |= P.take_rebinding(self.spec.params[i], own, self.spec.names[i])
        return taken

    def shard_written(self) -> bool:
        """Whether the shard was written from outside (through ``ds_tensor``) since it last
        followed the master."""
        self.take_rebinds()
        return self.shard._version != self._shard_version

    def take_shard_writes(self) -> None:
        """The master takes what was written into the shard through ``ds_tensor``: the
        elements whose shard value differs from the master's, rounded to the shard dtype
        (Note "writes through ds_tensor" in partition.py). Local; the caller has made sure
        no update is running on the master."""
        if not self.shard_written():
            return
        if self.shard is not self.master:
            with torch.no_grad():
                shard = self.shard.to(self.master.device)
                written = shard != self.master.to(shard.dtype)
                self.master[written] = shard[written].to(self.master.dtype)
        self._shard_version = self.shard._version

    def regather(self) -> None:
        """A persistent unit gathers its new full values (collective); others wait for
        their next use."""
        if self.spec.persistent:
            self.state = UnitState.RELEASED
            self.start_gather()
            self.finish_gather()

    def _expect(self, *states: UnitState) -> None:
        if self.state not in states:
            raise StateError(f"unit {self.spec.name or '<root>'} is {self.state.value}, "
                             f"expected {' or '.join(s.value for s in states)}")
