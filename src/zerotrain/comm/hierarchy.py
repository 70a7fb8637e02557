"""Collectives over several node-aware groups: MiCS's replicated reduce-scatter, ZeRO++'s
quantized all-gather (qwZ) and quantized hierarchical reduce-scatter (qgZ).

Each is built from ``comm``'s primitives, so the ledger sees every byte with its reach.
A reduce-scatter here has the signature of ``Communicator.reduce_scatter`` (``out``: this
rank's row, ``input``: one row per rank of the sharding group, row-major) and returns a
work handle or None; the gradient buckets take one as a plug-in.

Note: two-step collectives in flight
    With ``async_op`` the first collective is launched and a handle returned whose
    ``wait()`` finishes it and then runs the second step (more collectives, on another
    group). The gradient buckets wait for their handles in launch order on every rank, so
    the second steps are issued in the same order everywhere and pair up.

Note: qgZ, the hierarchical all-to-all
    The sharding group is the whole world, ``K`` nodes of ``L`` ranks, rank ``k*L + l``
    (``topology.uniform``). Input row ``j`` is what this rank contributes to rank ``j``'s
    shard. Step 1 runs inside the node: rows are reordered by destination local index
    (``(K, L) -> (L, K)``), each row quantized to int4, and an all-to-all over the node hands
    local rank ``l`` the rows for ranks ``(k, l)`` from every node peer; it dequantizes and
    sums them (node partial sums). Step 2 crosses nodes once: those ``K`` partial rows,
    quantized again, go by all-to-all over the cross-node group of local index ``l`` to
    their owners ``(k, l)``, which dequantize and sum. Per rank the cross-node step carries
    ``K`` rows instead of the ``K*L`` rows of a flat reduce-scatter, in 4 bits instead of
    16 or 32. Sums run in fp32 in a fixed order; only the two quantizations are lossy.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .communicator import Communicator
from ..core.quantize import BlockQuantizer

QWZ = BlockQuantizer(bits=8, block=256)   # parameters: int8 blocks (ZeRO++ qwZ)
QGZ = BlockQuantizer(bits=4, block=256)   # gradients: int4 blocks (ZeRO++ qgZ)


class ReplicatedReduceScatter:
    """MiCS: reduce-scatter inside the shard group, then all-reduce that shard over the
    replicas (the ranks holding the same shard in the other groups)."""

    def __init__(self, shard: Communicator, replicas: Communicator) -> None:
        self.shard = shard
        self.replicas = replicas

    def __call__(self, out: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                 label: str = "") -> Optional["Then"]:
        def across() -> None:
            if self.replicas.world_size > 1:
                self.replicas.all_reduce(out, label=f"{label} across replicas")
        work = self.shard.reduce_scatter(out, input, async_op=async_op, label=label)
        return Then(work, across, async_op)


class QuantizedHierarchicalReduceScatter:
    """qgZ over the world: int4 all-to-all inside the node, then across nodes (Note: qgZ)."""

    def __init__(self, world: Communicator, node: Communicator, cross: Communicator, *,
                 quantizer: BlockQuantizer = QGZ) -> None:
        self.world_size = world.world_size
        self.node = node
        self.cross = cross
        self.quantizer = quantizer

    def __call__(self, out: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                 label: str = "") -> Optional["Then"]:
        local, nodes, chunk = self.node.world_size, self.cross.world_size, out.numel()
        if input.numel() != self.world_size * chunk:
            raise ValueError(f"reduce_scatter input has {input.numel()} elements, expected "
                             f"{self.world_size} x {chunk}")
        rows = input.view(nodes, local, chunk).transpose(0, 1).reshape(local * nodes, chunk)
        work, received = self._send(self.node, rows, async_op, label)

        def across() -> None:
            partial = self._sum(received, local, nodes, chunk)                # (K, chunk)
            _, back = self._send(self.cross, partial, False, label)
            out.copy_(self._sum(back, nodes, 1, chunk).view(-1))
        return Then(work, across, async_op)

    def _send(self, comm: Communicator, rows: torch.Tensor, async_op: bool, label: str):
        """All-to-all of quantized rows, cut into ``comm.world_size`` equal parts."""
        packed = self.quantizer.quantize(rows)              # (rows, P)
        received = torch.empty_like(packed)
        work = comm.all_to_all(received, packed, async_op=async_op, label=f"{label} (qgZ)")
        return work, received

    def _sum(self, received: torch.Tensor, parts: int, per_part: int,
             chunk: int) -> torch.Tensor:
        """The fp32 sum over the senders of what arrived, ``(per_part, chunk)``."""
        values = self.quantizer.dequantize(received, chunk, torch.float32)
        return values.view(parts, per_part, chunk).sum(dim=0)


class Then:
    """A first collective in flight and the step that follows it (Note: two-step
    collectives in flight). Synchronous (``async_op`` False): the step has already run."""

    def __init__(self, work, rest: Callable[[], None], async_op: bool) -> None:
        self._work = work
        self._rest: Optional[Callable[[], None]] = rest
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self._rest is None:
            return
        if self._work is not None:
            self._work.wait()
        rest, self._rest = self._rest, None
        rest()


class QuantizedAllGather:
    """qwZ: each rank's shard as int8 blocks; every rank decodes every row (its own too),
    so all ranks use identical parameter values."""

    def __init__(self, comm: Communicator, *, quantizer: BlockQuantizer = QWZ) -> None:
        self.comm = comm
        self.quantizer = quantizer

    def start(self, shard: torch.Tensor, *, label: str = "") -> "PendingGather":
        packed = self.quantizer.quantize(shard.reshape(1, -1)).view(-1)
        out = torch.empty(self.comm.world_size * packed.numel(), dtype=torch.uint8,
                          device=packed.device)
        work = self.comm.all_gather(out, packed, async_op=True, label=f"{label} (qwZ)")
        return PendingGather(work, out, self, shard.numel(), shard.dtype)


class PendingGather:
    """A quantized all-gather in flight; ``wait()`` gives the decoded ``(world,
    shard_numel)`` rows."""

    def __init__(self, work, out: torch.Tensor, gather: QuantizedAllGather, numel: int,
                 dtype: torch.dtype) -> None:
        self._work = work
        self._out = out
        self._gather = gather
        self._numel = numel
        self._dtype = dtype

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        rows = self._out.view(self._gather.comm.world_size, -1)
        return self._gather.quantizer.dequantize(rows, self._numel, self._dtype)
