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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..comm import Communicator
from ..flat import FlatLayout
from ..hierarchy import PendingGather, QuantizedAllGather, plain_gather

NO_BUCKET_LIMIT = 1 << 62  # one block per layout: a unit is one collective


@dataclass(slots=True)
class GatherSlice:
    """Where a group of the unit's parameters sits in a gathered ``(world, numel)`` matrix."""

    indices: list[int]        # positions in the unit's parameter list
    layout: FlatLayout
    column: int


class Gathering:
    """An all-gather in flight; ``wait()`` gives the rows and how to read them."""

    def __init__(self, pending: PendingGather, slices: Sequence) -> None:
        self._pending = pending
        self.slices = slices

    def wait(self) -> torch.Tensor:
        return self._pending.wait()


class UnitWire:
    """Gathers from the primary partition over ``comm``, with int8 blocks if ``quantized``."""

    def __init__(self, comm: Communicator, *, quantized: bool = False) -> None:
        self.comm = comm
        self._quantized = QuantizedAllGather(comm) if quantized else None

    def start(self, unit, *, label: str) -> Gathering:
        """Launch the unit's all-gather (collective over the group, asynchronous)."""
        shard, launch_after_copy = unit.shard_on_device()
        with launch_after_copy:
            if self._quantized is not None:
                pending = self._quantized.start(shard, label=label)
            else:
                pending = plain_gather(self.comm, shard, unit.device, label=label)
        return Gathering(pending, unit.slices)

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
        self._units: dict[int, _Secondary] = {}

    def start(self, unit, *, label: str) -> Gathering:
        kept = self._units.get(unit.spec.index)
        if kept is None or not kept.valid:
            return super().start(unit, label=label)
        return Gathering(plain_gather(self.secondary, kept.shard, unit.device,
                                      label=f"{label} (hpZ)"), kept.slices)

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


def gather_rows_into(rows: torch.Tensor, slices: Sequence, views: Sequence[torch.Tensor]
                     ) -> None:
    """Write a gathered ``(world, numel)`` matrix into the parameters' full views (``slices``:
    the unit's ``GroupSlice``s or a secondary partition's ``GatherSlice``s)."""
    with torch.no_grad():
        for s in slices:
            cols = rows[:, s.column: s.column + s.layout.shard_numel]
            for slot, i in zip(s.layout.slots, s.indices):
                s.layout.copy_block_into_full(cols, slot, views[i])
