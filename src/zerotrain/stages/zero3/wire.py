"""How a unit's full parameters reach every rank: the primary all-gather (plain or int8,
qwZ) and ZeRO++'s secondary partition inside the node (hpZ).

Note: the secondary partition (hpZ)
    With ``zero_hpz_partition_size`` H, every gather from the primary partition (over the
    whole world, across nodes) also leaves each rank its chunk of the unit over a group of
    H ranks that share a node (``GroupSlice`` layouts like the primary's, over H ranks):
    ``Ψ_unit / H`` elements kept in the parameter dtype. Until the unit's shards change (an
    optimizer step publishes new values, a checkpoint loads, ``GatheredParameters`` writes),
    the next gathers, backward's and the next micro-step's forward, all-gather those chunks
    inside the node instead. The values are the same bits, so results equal plain stage 3
    exactly; the cost is the secondary copy, Ψ/H elements per rank. Persistent units stay
    gathered and keep no secondary copy. Every rank takes the same decisions in the same
    order, so the collectives pair up.

Note: gathering in place
    Rank ``r``'s chunk of parameter ``p`` is one contiguous slice of its shard
    (``GroupSlice.column`` plus ``FlatLayout.shard_slice``), and the gathered chunks, in rank
    order, are ``p`` itself followed by its zero padding. So each parameter is all-gathered
    on its own, straight into its segment of the unit's ``full`` buffer (``unit.py``,
    Note: unit tensors), and all of a unit's gathers go out as one launch on a GPU
    (on the host one launch each, Note "coalesced gathers" in ``comm/coalesced.py``).
    Nothing is copied after those gathers: the parameters' views read the values where the
    collective wrote them. Two exceptions carry the gather check's header (Note "gather
    check" in ``gather_check.py``): on a device the whole unit is one flat gather copied
    out after; on the host a header-only gather goes first. The same holds for
    the secondary partition (its chunks have the same structure over H ranks). Only qwZ
    copies: its int8 rows have to be decoded anyway, and the decoded values are written
    into the views (``DequantizingGathering``). So do frozen parameters kept as int8
    (``zero_quantized_nontrainable_weights``, ``frozen.py``): their packed chunks go out as
    they are stored, in a second collective of the same launch, and are decoded into their
    segments (``FrozenGathering``).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import ContextManager, Iterator, Sequence

import torch

from ...comm import Communicator
from ...core.flat import FlatLayout
from ...comm.hierarchy import PendingGather, QuantizedAllGather
from .gather_check import GatherCheck, HostLaunches, start_checked

NO_BUCKET_LIMIT = 1 << 62  # one block per layout: a unit is one launch


@dataclass(slots=True)
class GatherSlice:
    """Where a group of the unit's parameters sits in a secondary shard."""

    indices: list[int]        # positions in the unit's parameter list
    layout: FlatLayout
    column: int


class DequantizingGathering:
    """qwZ: the int8 rows arrive in a buffer of their own and must be decoded anyway; the
    decoded values are then written into the parameters' views, one copy per parameter,
    which the quantization makes inherent."""

    def __init__(self, pending: PendingGather, slices: Sequence,
                 views: Sequence[torch.Tensor]) -> None:
        self._pending = pending
        self._slices = slices
        self._views = views

    def wait(self) -> None:
        rows = self._pending.wait()   # (world, shard_numel), decoded
        with torch.no_grad():
            for s in self._slices:
                cols = rows[:, s.column: s.column + s.layout.shard_numel]
                for slot, i in zip(s.layout.slots, s.indices):
                    s.layout.copy_block_into_full(cols, slot, self._views[i])


class FrozenGathering:
    """A unit's packed int8 frozen chunks in flight (Note "quantized frozen shards" in
    ``frozen.py``); ``wait()`` decodes every rank's rows into the parameters' segments."""

    def __init__(self, work, rows: torch.Tensor, frozen, segments: Sequence[torch.Tensor],
                 world: int) -> None:
        self._work = work
        self._rows = rows
        self._frozen = frozen
        self._segments = segments
        self._world = world

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        self._frozen.decode_into(self._rows, self._segments, self._world)


class Gatherings:
    """Several gatherings of one unit, finished in launch order."""

    def __init__(self, parts: Sequence) -> None:
        self._parts = list(parts)

    def wait(self) -> None:
        for part in self._parts:
            part.wait()

    def settle(self) -> None:
        """Wait for every part, ignoring their errors: a later launch failed, and ``full``
        may be freed only once nothing writes into it any more."""
        for part in self._parts:
            try:
                part.wait()
            except Exception:   # the launch failure is the error that is reported
                pass


def gather_pieces(slices: Sequence, segments: Sequence[torch.Tensor], shard: torch.Tensor,
                  world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per parameter with elements: where its gather lands (the first ``world * chunk``
    elements of its segment of ``full``) and this rank's chunk of it in ``shard``
    (``slices``: the unit's ``GroupSlice``s or a secondary partition's ``GatherSlice``s)."""
    outputs, inputs = [], []
    for s in slices:
        for slot, i in zip(s.layout.slots, s.indices):
            if slot.chunk:
                where = s.layout.shard_slice(slot)
                outputs.append(segments[i][: world * slot.chunk])
                inputs.append(shard[s.column + where.start: s.column + where.stop])
    return outputs, inputs


@contextlib.contextmanager
def _after_compute(launch: ContextManager, device: torch.device) -> Iterator[None]:
    """Enter ``launch`` (the stream a host shard went up on) behind the work already queued
    on the compute stream: ``full``'s storage was allocated there, from memory that work
    may still use. Without CUDA there is nothing to order."""
    if device.type != "cuda":
        with launch:
            yield
        return
    compute = torch.cuda.current_stream(device)
    with launch:
        torch.cuda.current_stream(device).wait_stream(compute)
        yield


class UnitWire:
    """Gathers from the primary partition over ``comm``, with int8 blocks if ``quantized``."""

    def __init__(self, comm: Communicator, *, quantized: bool = False) -> None:
        self.comm = comm
        self._quantized = QuantizedAllGather(comm) if quantized else None
        self.quantized = quantized
        self.check = GatherCheck(enabled=comm.carries_data)   # Note "gather check" there
        self.host = HostLaunches(comm, self.check)   # Note "held reductions" there

    def padded_numel(self, numel: int) -> int:
        """Elements of a parameter's segment of ``full``: room for every gather this wire
        lands there, padding included."""
        return self.comm.world_size * math.ceil(numel / self.comm.world_size)

    def start(self, unit, *, label: str):
        """Launch the unit's gather into its ``full`` buffer, whose storage has its bytes
        (collective over the group, asynchronous); ``wait()`` on the result finishes it."""
        parts = []
        if unit.shard_numel:
            shard, launch = unit.shard_on_device()
            with _after_compute(launch, unit.device):
                if self._quantized is not None:
                    parts.append(DequantizingGathering(
                        self._quantized.start(shard, label=label), unit.slices, unit.views))
                else:
                    outputs, inputs = gather_pieces(unit.slices, unit.segments, shard,
                                                    self.comm.world_size)
                    parts.extend(start_checked(self.comm, self.check, unit.spec.index, shard,
                                               outputs, inputs, label=label, host=self.host))
        return self._with_frozen(parts, unit, label)

    def decoy(self, unit, *, label: str) -> None:
        """The all-gathers of ``unit``'s plain gather, into scratch buffers, waited for: what
        a rank that left the cycle's plan sends (Note "launch plans" in ``plan.py``)."""
        if not unit.shard_numel:
            return
        shard, launch = unit.shard_on_device()
        with _after_compute(launch, unit.device):
            scratch = [torch.empty(n, dtype=shard.dtype, device=unit.device)
                       for n in unit._segment_numels()]
            outputs, inputs = gather_pieces(unit.slices, scratch, shard, self.comm.world_size)
            if outputs:
                self.comm.all_gather_into_many(outputs, inputs, label=label).wait()

    def _with_frozen(self, parts: list, unit, label: str) -> Gatherings:
        """Add the gather of the unit's int8 frozen chunks, from the primary partition."""
        if unit.frozen is not None and unit.frozen.packed.numel():
            packed, launch = unit.frozen_on_device()
            world = self.comm.world_size
            try:
                with _after_compute(launch, unit.device):
                    out = torch.empty(world * packed.numel(), dtype=packed.dtype,
                                      device=packed.device)
                    work = self.comm.all_gather(out, packed, async_op=True,
                                                label=f"{label} (int8 frozen)")
            except BaseException:
                Gatherings(parts).settle()   # the caller frees ``full`` next
                raise
            parts.append(FrozenGathering(work, out.view(world, -1), unit.frozen,
                                         unit.segments, world))
        return Gatherings(parts)

    def gathered(self, unit, views: Sequence[torch.Tensor]) -> None:
        """The unit's full values are in ``views`` (one per parameter)."""

    def shards_changed(self, unit) -> None:
        """The unit's shards were written: copies derived from them are stale."""

    def tensors(self) -> list[torch.Tensor]:
        """Buffers this wire keeps between gathers (for memory accounting)."""
        return []


@dataclass(slots=True)
class _Secondary:
    slices: list[GatherSlice]
    shard: torch.Tensor
    valid: bool = False


class SecondaryPartitionWire(UnitWire):
    """hpZ: the primary gather also fills a secondary chunk; later gathers read it inside
    the node (Note: the secondary partition)."""

    def __init__(self, comm: Communicator, secondary: Communicator, *,
                 quantized: bool = False) -> None:
        super().__init__(comm, quantized=quantized)
        self.secondary = secondary
        self._secondary_host = HostLaunches(secondary, self.check)
        self._units: dict[int, _Secondary] = {}

    def padded_numel(self, numel: int) -> int:
        world = self.secondary.world_size
        return max(super().padded_numel(numel), world * math.ceil(numel / world))

    def start(self, unit, *, label: str):
        kept = self._units.get(unit.spec.index)
        if kept is None or not kept.valid:
            return super().start(unit, label=label)
        outputs, inputs = gather_pieces(kept.slices, unit.segments, kept.shard,
                                        self.secondary.world_size)
        parts = start_checked(self.secondary, self.check, unit.spec.index, kept.shard,
                              outputs, inputs, label=f"{label} (hpZ)",
                              host=self._secondary_host)
        return self._with_frozen(parts, unit, label)   # int8 frozen: primary partition

    def gathered(self, unit, views: Sequence[torch.Tensor]) -> None:
        if unit.spec.persistent or not unit.spec.params:
            return
        kept = self._units.get(unit.spec.index)
        if kept is None:
            kept = self._units[unit.spec.index] = self._allocate(unit, views)
        if kept.valid:
            return
        rank = self.secondary.rank
        with torch.no_grad():
            for s in kept.slices:
                for slot, i in zip(s.layout.slots, s.indices):
                    where = s.layout.shard_slice(slot)
                    kept.shard[s.column + where.start: s.column + where.stop].copy_(
                        s.layout.shard_of_full(views[i], slot, rank))
        kept.valid = True

    def _allocate(self, unit, views: Sequence[torch.Tensor]) -> _Secondary:
        slices, column = [], 0
        for s in unit.slices:
            layout = FlatLayout([views[i].numel() for i in s.indices],
                                world=self.secondary.world_size, bucket_numel=NO_BUCKET_LIMIT)
            slices.append(GatherSlice(list(s.indices), layout, column))
            column += layout.shard_numel
        shard = torch.zeros(column, dtype=views[0].dtype, device=unit.device)
        return _Secondary(slices, shard)

    def shards_changed(self, unit) -> None:
        kept = self._units.get(unit.spec.index)
        if kept is not None:
            kept.valid = False

    def tensors(self) -> list[torch.Tensor]:
        return [kept.shard for kept in self._units.values()]
