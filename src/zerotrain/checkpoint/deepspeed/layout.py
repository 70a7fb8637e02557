"""Where each parameter's elements sit in DeepSpeed's flat fp32 partitions.

Note: DeepSpeed's partitions
    Stages 1 and 2 (and the bf16 optimizer) flatten each parameter group in the order of
    ``param_shapes`` (a parameter followed by its ``param_alignment_paddings`` entry, if the
    file has one), pad the group, and give rank ``r`` elements ``[r*P, (r+1)*P)`` of it:
    ``P`` is the partition size, the saved fp32 partition's length plus the group padding
    when the saved partition is "lean" (``zero_stage`` present: stages 1 and 2 strip the
    padding on save; the bf16 optimizer does not). Adam's moments are flat tensors of the
    same partition. Stage 3 partitions every parameter on its own: with ``c = ceil(numel /
    W)`` rank ``r`` holds elements ``[r*c, min((r+1)*c, numel))``, and a rank's flat
    partitions (one per sub-group, in ``param_shapes`` order) concatenate those chunks. This
    is the arithmetic of DeepSpeed's ``zero_to_fp32.py``; here it yields, per parameter,
    the list of :class:`Piece` s a reader copies from.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

from ..manifest import CheckpointError


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, end)`` of a parameter are elements ``[offset, offset + end -
    start)`` of flat partition ``flat`` of rank ``rank``."""

    rank: int
    flat: int
    offset: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class SourceParam:
    """A trainable parameter of the checkpoint: full shape, optimizer group, pieces."""

    name: str
    shape: tuple[int, ...]
    group: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def zero12_params(param_shapes: Sequence[dict], partition_numels: Sequence[int],
                  alignment_paddings: Sequence[Sequence[int]] | None,
                  world: int) -> list[SourceParam]:
    """Stages 1-2 and the bf16 optimizer (Note: DeepSpeed's partitions); group ``g`` has
    partition size ``partition_numels[g]``."""
    out = []
    for group, shapes in enumerate(param_shapes):
        size = partition_numels[group]
        paddings = alignment_paddings[group] if alignment_paddings else [0] * len(shapes)
        if len(paddings) != len(shapes):
            raise CheckpointError(f"param_alignment_paddings of group {group} has "
                                  f"{len(paddings)} entries for {len(shapes)} parameters")
        cursor = 0
        for (name, shape), padding in zip(shapes.items(), paddings):
            numel = math.prod(shape)
            pieces = []
            for rank in range(cursor // size if size else 0, world):
                lo, hi = max(cursor, rank * size), min(cursor + numel, (rank + 1) * size)
                if lo >= hi:
                    break
                pieces.append(Piece(rank, group, lo - rank * size, lo - cursor, hi - cursor))
            if sum(p.end - p.start for p in pieces) != numel:
                raise CheckpointError(f"parameter {name!r} ({numel} elements) does not fit in "
                                      f"group {group}'s {world} partitions of {size}")
            out.append(SourceParam(name, tuple(shape), group, tuple(pieces)))
            cursor += numel + padding
    return out


def zero3_params(param_shapes: Sequence[dict], flat_numels: Sequence[int],
                 group_of_flat: Sequence[int], world: int) -> list[SourceParam]:
    """Stage 3 (Note: DeepSpeed's partitions); ``flat_numels`` are the lengths of rank 0's
    flat partitions, ``group_of_flat`` the optimizer group of each."""
    starts = [0]
    for numel in flat_numels:
        starts.append(starts[-1] + numel)
    out, cursor = [], 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            chunk = math.ceil(numel / world)
            flat = bisect.bisect_right(starts, cursor) - 1
            if flat >= len(flat_numels) or cursor + chunk > starts[flat + 1]:
                raise CheckpointError(f"parameter {name!r} lies outside the saved flat fp32 "
                                      f"partitions ({starts[-1]} elements per rank)")
            offset = cursor - starts[flat]
            pieces = tuple(Piece(rank, flat, offset, rank * chunk,
                                 min((rank + 1) * chunk, numel))
                           for rank in range(world) if rank * chunk < numel)
            out.append(SourceParam(name, tuple(shape), group_of_flat[flat], pieces))
            cursor += chunk
    if cursor != starts[-1]:
        raise CheckpointError(f"the parameters use {cursor} elements per rank but the saved "
                              f"flat fp32 partitions hold {starts[-1]}")
    return out
