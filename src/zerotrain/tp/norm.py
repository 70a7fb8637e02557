"""The gradient norm over both dimensions of the mesh (``stages/base.py``'s ``NormSpan``).

Note: replicated parameters counted once
    A split parameter's squared gradient is spread over the T ranks of its tensor-parallel
    group (each holds a different slice); a replicated one (an embedding, a norm) has the
    same gradient on all T. Summing every rank's squares over the whole world therefore
    counts a replicated parameter T times; each rank weights its replicated slots by 1/T
    before the one all-reduce, so the sum is the norm of the model's whole gradient, as
    one process would take it. Below stage 1 the gradient is whole on every data-parallel
    rank, so the sum runs over the tensor-parallel group only.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..comm import Communicator
from ..core.flat import FlatLayout


class TensorParallelNorm:
    """Squares of a stage's records, weighted (Note: replicated parameters counted once)."""

    def __init__(self, comm: Communicator, tp_size: int,
                 split: Sequence[Sequence[bool]]) -> None:
        """``split[k][i]``: whether parameter i of record k is split over the group."""
        self.comm = comm
        self.tp_size = tp_size
        self.split = [list(s) for s in split]

    def square(self, index: int, layout: FlatLayout, shard: torch.Tensor) -> torch.Tensor:
        flags = self.split[index]
        total = torch.linalg.vector_norm(shard, dtype=torch.float32).square()
        if all(flags):
            return total
        replicated = torch.zeros((), dtype=torch.float32, device=shard.device)
        for slot, is_split in zip(layout.slots, flags):
            if not is_split and slot.chunk:
                replicated += torch.linalg.vector_norm(shard[layout.shard_slice(slot)],
                                                       dtype=torch.float32).square()
        return total - replicated * (1.0 - 1.0 / self.tp_size)
