"""How one parameter is split over a tensor-parallel group, as pure tensor arithmetic.

Note: fused sections
    A fused weight holds several matrices stacked along the split dimension (GPT-2's
    ``c_attn``: q, k and v; ``gate_up_proj``: gate and up). Splitting it whole would give
    rank 0 all of q and half of k; so each of its ``sections`` is split on its own and rank
    t holds, in order, slice t of every section. With one section this is the plain split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True, slots=True)
class SplitSpec:
    """``dim``: the dimension split over ``size`` ranks; ``sections``: matrices fused along
    it (Note: fused sections). A replicated parameter has no spec."""

    dim: int
    size: int
    sections: int = 1

    def full_shape(self, local: Sequence[int]) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] *= self.size
        return tuple(shape)

    def divides(self, full: Sequence[int]) -> bool:
        """Whether every section of ``full`` splits evenly over the group."""
        return full[self.dim] % (self.sections * self.size) == 0


def local_slice(full: torch.Tensor, spec: SplitSpec, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` (a new contiguous tensor)."""
    section = full.shape[spec.dim] // spec.sections
    piece = section // spec.size
    parts = [full.narrow(spec.dim, s * section + rank * piece, piece)
             for s in range(spec.sections)]
    return torch.cat(parts, dim=spec.dim).contiguous()


def join_slices(pieces: Sequence[torch.Tensor], spec: SplitSpec) -> torch.Tensor:
    """The full tensor from every rank's part, in rank order (inverse of local_slice)."""
    piece = pieces[0].shape[spec.dim] // spec.sections
    parts = [p.narrow(spec.dim, s * piece, piece)
             for s in range(spec.sections) for p in pieces]
    return torch.cat(parts, dim=spec.dim).contiguous()
