"""The two-dimensional mesh of tensor parallelism under ZeRO, and its collectives.

Note: the mesh
    ``tensor_parallel.autotp_size`` T arranges the N ranks as a (N/T) x T grid, tensor
    parallel innermost, as DeepSpeed's ``groups._init_tp_mesh_device`` does: global rank
    ``r`` is tensor-parallel rank ``r % T`` in the group ``[r - r % T, ..., + T - 1]`` and
    data-parallel rank ``r // T`` in the group of ranks with the same ``r % T``. The ranks of
    one tensor-parallel group see the same batch and hold different slices of the split
    layers; ZeRO shards and reduces over the data-parallel group only. Both groups are
    :class:`Communicator` subgroups (one ``new_group`` per row and per column, as a
    ``DeviceMesh`` would make); the layout is also available as a ``torch.distributed``
    ``DeviceMesh`` (:meth:`Mesh.device_mesh`) for code that wants one.

Note: the tensor-parallel wire
    The split layers communicate only through the two autograd functions here, Megatron's
    f and g operators: :func:`copy_to_tensor_parallel` is the identity forward and sums the
    input gradient over the group backward (before a column-parallel layer, whose input
    every rank of the group holds whole); :func:`reduce_from_tensor_parallel` sums the
    partial outputs of a row-parallel layer forward and passes the gradient through
    backward. Their bytes go to the tensor-parallel communicator's own ledger, so the
    data-parallel figures stay those of ZeRO and each dimension is reported apart.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from .communicator import Communicator
from .ledger import CommLedger


class DataParallelAxis:
    """The data-parallel column of a two-dimensional mesh (tensor or sequence parallel
    innermost), with the sizes its users ask for by DeepSpeed's names."""

    dp: Communicator

    @property
    def dp_size(self) -> int:
        return self.dp.world_size

    @property
    def dp_rank(self) -> int:
        return self.dp.rank


@dataclass(frozen=True)
class Mesh(DataParallelAxis):
    """This rank's place in the (data parallel) x (tensor parallel) grid (Note: the mesh).

    ``world``: every rank (the engine's communicator); ``tp``: the T ranks sharing a batch;
    ``dp``: the N/T ranks with the same tensor-parallel rank, over which ZeRO shards.
    """

    world: Communicator
    tp: Communicator
    dp: Communicator

    @property
    def tp_size(self) -> int:
        return self.tp.world_size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    def device_mesh(self):
        """The same grid as a ``torch.distributed.device_mesh.DeviceMesh`` with dimensions
        ``("data_parallel", "tensor_parallel")`` (collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(self.world.device.type, (self.dp_size, self.tp_size),
                                mesh_dim_names=("data_parallel", "tensor_parallel"))


def grid_groups(world: Communicator, inner: int) -> tuple[Communicator, Communicator]:
    """The two groups of an (N/inner) x inner grid of ``world``'s ranks: the column of
    ranks with this rank's place in its row (its data-parallel group) and this rank's row
    of ``inner`` consecutive ranks, the latter with a ledger of its own (Note: the
    tensor-parallel wire). Collective over the default group."""
    n = world.world_size
    rows = [tuple(range(start, start + inner)) for start in range(0, n, inner)]
    columns = [tuple(range(i, n, inner)) for i in range(inner)]
    dp = world.subgroup(columns)
    row = world.subgroup(rows)
    row = Communicator(row.group, debug=world.debug, topology=world.topology,
                       ledger=CommLedger())
    return dp, row


def build_mesh(world: Communicator, tp_size: int) -> Mesh:
    """The mesh of ``world`` (the default group) for ``tp_size`` ranks per tensor-parallel
    group. Collective over the default group: every rank calls it with the same size."""
    n = world.world_size
    if tp_size < 1 or n % tp_size:
        raise ValueError(f"tensor-parallel size {tp_size} does not divide the world size {n}")
    dp, tp = grid_groups(world, tp_size)
    return Mesh(world=world, tp=tp, dp=dp)


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, gradient summed over the group backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, label: str) -> torch.Tensor:
        ctx.comm, ctx.label = comm, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, label=f"tensor parallel backward {ctx.label}")
        return grad, None, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: partial outputs summed over the group forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, label: str) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, label=f"tensor parallel forward {label}")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def copy_to_tensor_parallel(x: torch.Tensor, comm: Communicator,
                            label: str = "") -> torch.Tensor:
    """The input of a column-parallel layer (Note: the tensor-parallel wire); every rank of
    ``comm`` calls it, in the same order."""
    if comm.world_size == 1 or not torch.is_grad_enabled() or not x.requires_grad:
        return x
    return _CopyToTensorParallel.apply(x, comm, label)


def reduce_from_tensor_parallel(x: torch.Tensor, comm: Communicator,
                                label: str = "") -> torch.Tensor:
    """The summed output of a row-parallel layer (Note: the tensor-parallel wire); every
    rank of ``comm`` calls it, in the same order."""
    if comm.world_size == 1:
        return x
    return _ReduceFromTensorParallel.apply(x, comm, label)
