"""The mesh of Ulysses sequence parallelism under ZeRO, and its collectives.

Note: the sequence mesh
    A sequence-parallel size S arranges the N ranks as DeepSpeed's ``parallel_state_sp``
    does: the ranks ``[g*S, ..., g*S + S - 1]`` form sequence-parallel group g (they hold
    shards of the same sequences and exchange attention heads); the ranks with the same
    sequence-parallel rank form a data-parallel group of N/S; and all N ranks together are
    the sequence-data-parallel group, over which ZeRO partitions and reduces, averaging over
    the N/S data-parallel ranks only (DeepSpeed divides the summed gradient by
    ``seq_dp_world / sp_size``). The sequence-parallel communicator has a ledger of its
    own, so ZeRO's figures stay those of the world and each dimension is reported apart.

Note: the head exchange
    Ulysses attention needs one differentiable collective, the dimension-0 all-to-all of
    DeepSpeed's ``_dim_zero_all_to_all``: part j of rank r's input becomes part r of rank
    j's output. Its gradient is the same exchange of the output gradient, so the backward
    pass launches as many all-to-alls as the forward, in the same order on every rank.
    Before the first exchange of a forward, the ranks agree on the shapes they hold
    (:func:`check_same_shapes`): an all-to-all of mismatched sizes would hang or fail deep
    inside the backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..errors import RankMismatchError
from .communicator import Communicator
from .mesh import DataParallelAxis, grid_groups


@dataclass(frozen=True)
class SequenceMesh(DataParallelAxis):
    """This rank's place in the (data parallel) x (sequence parallel) grid (Note: the
    sequence mesh). ``world``: every rank, the sequence-data-parallel group;
    ``sp``: the S ranks sharing sequences; ``dp``: the N/S ranks with this sequence rank."""

    world: Communicator
    sp: Communicator
    dp: Communicator

    @property
    def sp_size(self) -> int:
        return self.sp.world_size

    @property
    def sp_rank(self) -> int:
        return self.sp.rank


def build_sequence_mesh(world: Communicator, sp_size: int) -> SequenceMesh:
    """The mesh of ``world`` (the default group) for ``sp_size`` ranks per sequence-parallel
    group. Collective over the default group: every rank calls it with the same size."""
    n = world.world_size
    if sp_size < 2:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sp_size}")
    if n % sp_size:
        raise ValueError(f"sequence_parallel_size {sp_size} does not divide the world size {n}")
    dp, sp = grid_groups(world, sp_size)   # Note: the sequence mesh: sp has a ledger of its own
    return SequenceMesh(world=world, sp=sp, dp=dp)


class _DimZeroAllToAll(torch.autograd.Function):
    """Part j of dimension 0 goes to rank j; the backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, label: str) -> torch.Tensor:
        ctx.comm, ctx.label = comm, label
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all(out, x, label=f"sequence parallel forward {label}")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad, label=f"sequence parallel backward {ctx.label}")
        return out, None, None


def all_to_all_dim0(x: torch.Tensor, comm: Communicator, label: str = "") -> torch.Tensor:
    """The differentiable dimension-0 exchange (Note: the head exchange): ``x.shape[0]``
    must be ``comm.world_size``. Every rank of ``comm`` calls it, in the same order."""
    if x.shape[0] != comm.world_size:
        raise ValueError(f"all_to_all_dim0 needs dimension 0 of size {comm.world_size} (the "
                         f"sequence-parallel size), got shape {tuple(x.shape)}")
    return _DimZeroAllToAll.apply(x, comm, label)


def gather_along(x: torch.Tensor, comm: Communicator, dim: int, label: str = "") -> torch.Tensor:
    """Every rank's ``x`` (equal shapes) concatenated along ``dim`` in rank order; not
    differentiable. Every rank of ``comm`` calls it."""
    x = x.detach().contiguous()
    out = torch.empty((comm.world_size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out.view(-1), x.view(-1), label=label)
    return torch.cat(list(out.unbind(0)), dim=dim)


def check_same_shapes(comm: Communicator, what: str, shapes: Sequence[int],
                      device: Optional[torch.device] = None) -> None:
    """Raise :class:`RankMismatchError` on every rank of ``comm`` when the ranks hold
    different ``shapes`` (a few integers, the same count on every rank), naming the ranks
    and what they hold (Note: the head exchange). Collective."""
    mine = torch.tensor(list(shapes), dtype=torch.int64, device=device or comm.device)
    every = torch.empty((comm.world_size, mine.numel()), dtype=torch.int64, device=mine.device)
    comm.all_gather(every.view(-1), mine, label=f"sequence parallel shape check ({what})")
    rows = [tuple(int(v) for v in row) for row in every.tolist()]
    if len(set(rows)) > 1:
        held = ", ".join(f"rank {comm.ranks[i]}: {row}" for i, row in enumerate(rows))
        raise RankMismatchError(
            f"the ranks of one sequence-parallel group hold different {what} ({held}); "
            "each must hold its shard of the same batch (UlyssesSPDataLoaderAdapter)")


def gather_padded(x: torch.Tensor, comm: Communicator, label: str = "") -> list[torch.Tensor]:
    """Every rank's ``x`` (same dtype and number of dimensions, any sizes), in rank order;
    not differentiable. The shapes go first, then one gather of each tensor padded to the
    largest. Every rank of ``comm`` calls it."""
    x = x.detach()
    shapes = comm.all_gather_object(tuple(x.shape), label=f"{label} shapes")
    if len({len(s) for s in shapes}) > 1:
        raise RankMismatchError(f"{label}: the ranks of one sequence-parallel group hold "
                                f"tensors of different ranks: {shapes}")
    largest = [max(s[d] for s in shapes) for d in range(x.dim())]
    padded = torch.zeros(largest, dtype=x.dtype, device=x.device)
    padded[tuple(slice(0, n) for n in x.shape)] = x
    every = torch.empty((comm.world_size, *largest), dtype=x.dtype, device=x.device)
    comm.all_gather(every.view(-1), padded.view(-1), label=label)
    return [every[i][tuple(slice(0, n) for n in s)].clone() for i, s in enumerate(shapes)]
