"""Gradient buckets: filled from backward hooks, reduced over ranks block by block.

This module holds the three reductions, the only difference between stages 0, 1 and 2
for gradients, and is where the stages import the buckets from. What they share (which
block is complete, the one launch order every rank follows, the phases of a micro-step:
Notes "launch order" and "bucket phases") is ``bucket_launch.py``.

* :class:`AllReduceGrads` (stage 0): the whole gradient is accumulated locally and
  all-reduced at the accumulation boundary; every rank ends with the full sum.
* :class:`ReduceScatterAtBoundary` (stage 1): accumulated locally in full, reduce-scattered
  at the boundary; each rank keeps only its shard of the sum.
* :class:`ReduceScatterEveryMicroStep` (stage 2): every micro-step's gradients are
  reduce-scattered as soon as a block is complete and summed into the shard; no full
  gradient survives backward.

Note: communication dtype
    Gradients cross the wire in ``comm_dtype`` (``communication_data_type``; by default
    the dtype of the gradients autograd produces, as in DeepSpeed, so bf16 training moves
    half the bytes of fp32) and are accumulated in ``accum_dtype``
    (``data_types.grad_accum_dtype``). Stage 2 stages each micro-step's block in the
    communication dtype; stage 1 keeps its reduced shard in it. When a shard holds exactly
    one reduction its values are exact in the communication dtype, which
    :meth:`GradientBuckets.exact_dtype` reports, so offload can move it to the host in
    16 bits without changing a bit.

Note: releasing buckets
    At stage 2 a block's staging buffer is freed as soon as its reduction completes, with
    or without ``overlap_comm``; so backward holds at most the blocks still filling plus
    those in flight, never the whole gradient. Stage 2's reductions are asynchronous
    either way, launched from the hook that completes the block, so the backward of the
    next blocks runs while they travel (a synchronous one would hold the compute stream
    behind it on NCCL): ``MAX_IN_FLIGHT`` at a time with ``overlap_comm``, one without
    (DeepSpeed's default, which holds one bucket: here one filling and one travelling).
    Stages 0 and 1 keep their full accumulation buffer by design; with ``overlap_comm``
    their boundary's reductions too are launched asynchronously from the hooks during
    backward, without it they wait for the step (DeepSpeed's default: no overlap there).

Note: held backwards
    Inside ``engine.coalesce_grad_reduction()`` stage 2's (and 3's) buckets are
    ``holding``: a backward's gradients are summed on this rank, in ``accum_dtype``, into a
    full-size buffer per block (its staging buffer's shape), and nothing is launched. The
    block's exit is one reducing backward with no gradients of its own: each block's held
    sum becomes its staging buffer (cast to the communication dtype) and goes out as any
    backward's would, in the same order, bucketing and number of launches. So N backwards
    in the block issue the reduce-scatters of one, and the shard sum gets one reduction
    where it would have got N. The price is memory: until the exit a rank holds the
    whole unreduced gradient (every block's), in ``accum_dtype``, as DeepSpeed's block
    keeps every parameter's ``.grad``; outside the block no held buffer exists. The sum
    differs from N reductions only in the order its terms are added (each rank's
    backwards first, then the ranks), so it is the same bit for bit wherever those sums
    are exact, and within rounding otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import StateError
from ..core.flat import Block
# GradientBuckets, BucketPhase and MAX_IN_FLIGHT re-exported: the buckets' home for importers
from .bucket_launch import MAX_IN_FLIGHT, BucketPhase, GradientBuckets  # noqa: F401


class _FullAccumulation(GradientBuckets):
    """Stages 0 and 1: one full-size accumulation buffer per group, reduced at the boundary."""

    defer_without_overlap = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._full: list[Optional[torch.Tensor]] = [None] * len(self.layouts)

    def reduces_on(self, boundary: bool) -> bool:
        return boundary

    def _full_of(self, g: int) -> torch.Tensor:
        """Group ``g``'s full accumulator, allocated on first use."""
        full = self._full[g]
        if full is None:
            full = self._full[g] = torch.zeros(self.layouts[g].padded_numel,
                                               dtype=self.accum_dtype, device=self.device)
        return full

    def _block_flat(self, g: int, block: Block) -> torch.Tensor:
        layout = self.layouts[g]
        start = layout.world * block.shard_offset
        return self._full_of(g)[start: start + layout.block_full_numel(block)]

    def _accumulate(self, g, block, slot_index, grad) -> None:
        layout = self.layouts[g]
        matrix = layout.block_view(self._block_flat(g, block), block)
        layout.add_full_into_block(matrix, layout.slots[slot_index], grad)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self._full if t is not None]


class AllReduceGrads(_FullAccumulation):
    """Stage 0: all-reduce the full gradient; the 'shard' is the whole group."""

    def _launch(self, g, block) -> None:
        flat = self._block_flat(g, block)
        wire = self._wire(flat)
        work = self.comm.all_reduce(wire, async_op=self.overlap,
                                    label=f"gradient bucket {g}.{block.index}")
        def copy_back() -> None:
            flat.copy_(wire)

        self._track(work, None if wire is flat else copy_back)

    def reduced_shard(self, g: int) -> torch.Tensor:
        return self._full_of(g)  # allocated if nothing arrived

    def clear(self) -> None:
        for t in self._full:
            if t is not None:
                t.zero_()
        self._reductions = 0


class ReduceScatterAtBoundary(_FullAccumulation):
    """Stage 1: accumulate the full gradient, reduce-scatter it at the boundary."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._shard: list[Optional[torch.Tensor]] = [None] * len(self.layouts)

    def _launch(self, g, block) -> None:
        shard = self._shard_of(g)
        out = shard[block.shard_offset: block.shard_offset + block.chunk]
        self._track(self.reduce_scatter(out, self._wire(self._block_flat(g, block)),
                                             async_op=self.overlap,
                                             label=f"gradient bucket {g}.{block.index}"),
                    lambda: self._reduced(g))

    def _shard_of(self, g: int) -> torch.Tensor:
        """The reduced shard, in the communication dtype: it holds one reduction only."""
        shard = self._shard[g]
        if shard is None:
            shard = self._shard[g] = torch.empty(self.layouts[g].shard_numel,
                                                 dtype=self.comm_dtype, device=self.device)
        return shard

    def reduced_shard(self, g: int) -> torch.Tensor:
        shard = self._shard[g]
        if shard is None:
            raise StateError("no reduced gradient: step() before any boundary backward")
        return shard

    def clear(self) -> None:
        for t in self._full:
            if t is not None:
                t.zero_()
        self._shard = [None] * len(self.layouts)
        self._reductions = 0

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + [t for t in self._shard if t is not None]

    def reduced_tensors(self) -> list[torch.Tensor]:
        return [t for t in self._shard if t is not None]


class ReduceScatterEveryMicroStep(GradientBuckets):
    """Stage 2: reduce-scatter each micro-step's blocks into a persistent shard sum."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        self._shard: list[Optional[torch.Tensor]] = [None] * len(self.layouts)
        self._held: dict[tuple[int, int], torch.Tensor] = {}   # Note: held backwards

    def reduces_on(self, boundary: bool) -> bool:
        return True

    def _staging_of(self, g: int, block: Block) -> torch.Tensor:
        """One micro-step's gradients of a block, in the communication dtype (a parameter's
        gradient arrives once per backward, so nothing is summed in it but zeros); or what
        held backwards summed, which this reducing one sends (Note: held backwards)."""
        key = (g, block.index)
        if key not in self._staging:
            held = self._held.pop(key, None)
            if held is not None:
                self._staging[key] = held.to(self.comm_dtype)   # itself when already so
            else:
                numel = self.layouts[g].block_full_numel(block)
                self._staging[key] = torch.zeros(numel, dtype=self.comm_dtype,
                                                 device=self.device)
        return self._staging[key]

    def _held_of(self, g: int, block: Block) -> torch.Tensor:
        """The block's sum over the held backwards, in ``accum_dtype`` (Note: held
        backwards)."""
        key = (g, block.index)
        if key not in self._held:
            numel = self.layouts[g].block_full_numel(block)
            self._held[key] = torch.zeros(numel, dtype=self.accum_dtype, device=self.device)
        return self._held[key]

    def _accumulate(self, g, block, slot_index, grad) -> None:
        layout = self.layouts[g]
        flat = (self._held_of(g, block) if self.phase is BucketPhase.ACCUMULATING
                else self._staging_of(g, block))
        layout.add_full_into_block(layout.block_view(flat, block), layout.slots[slot_index],
                                   grad)

    def _launch(self, g, block) -> None:
        if self._shard[g] is None:
            self._shard[g] = torch.empty(self.layouts[g].shard_numel, dtype=self.accum_dtype,
                                         device=self.device)
        target = self._shard[g][block.shard_offset: block.shard_offset + block.chunk]
        staging = self._staging_of(g, block)
        key = (g, block.index)
        fresh = self._reductions == 0   # the shard holds nothing yet in this window
        direct = fresh and target.dtype == staging.dtype
        out = target if direct else torch.empty(target.shape, dtype=staging.dtype,
                                                device=target.device)
        # asynchronous whatever overlap_comm says (Note: releasing buckets)
        work = self.reduce_scatter(out, staging, async_op=True,
                                   label=f"gradient bucket {g}.{block.index}")

        def done() -> None:
            if not direct and fresh:
                target.copy_(out)
            elif not direct:
                target.add_(out)
            self._staging.pop(key)   # Note: releasing buckets
            self._reduced(g)
        self._track(work, done)

    def reduced_shard(self, g: int) -> torch.Tensor:
        shard = self._shard[g]
        if shard is None:
            raise StateError("no reduced gradient: step() before any backward")
        return shard

    def clear(self) -> None:
        """After the step the shard sum is consumed: free it (the next backward allocates
        it again), so between steps a rank holds no gradient at all. Held sums go too."""
        self._shard = [None] * len(self.layouts)
        self._held = {}
        self._reductions = 0

    @property
    def holds_gradients(self) -> bool:
        """Whether held backwards left sums that no reducing backward has sent yet."""
        return bool(self._held)

    def tensors(self) -> list[torch.Tensor]:
        return (list(self._staging.values()) + list(self._held.values())
                + [t for t in self._shard if t is not None])

    def reduced_tensors(self) -> list[torch.Tensor]:
        return [t for t in self._shard if t is not None]
