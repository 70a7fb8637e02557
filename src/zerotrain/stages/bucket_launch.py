"""Gradient buckets' machinery: when each block of gradients is reduced over ranks.

The three reductions (``buckets.py``) differ only in how a block is summed, launched and
kept; what they share lives here, so that each of them is a few methods: tracking which
parameters of a block have their gradient, launching blocks in one fixed order that every
rank follows, bounding the reductions in flight, and the phases of a micro-step.

Note: launch order
    Collectives must be issued in the same order on every rank or they pair up wrongly.
    Blocks are therefore launched strictly in one fixed order (the reverse of the layout,
    which is roughly the order backward produces gradients): a block whose gradients are all
    in waits for its predecessors, and whatever is still missing when backward ends is
    launched, in that order, by :meth:`GradientBuckets.finish`. A parameter that received no
    gradient on some rank contributes zeros; no rank ever skips a collective.

    The order in which hooks fire is therefore never relied on. It can differ between
    ranks: autograd runs each device's backward nodes on that device's own thread (CPU
    nodes on the caller's), and the order among ready nodes follows how the graph was
    built, so a CPU-side op, a host round trip or rank-dependent control flow reorders
    gradient arrival. What must hold is only that every rank produces every block's
    gradients before ``finish``; ``tests/dist/test_launch_order.py`` builds the graph in a
    different order on each rank, with a host round trip in backward, and checks that the
    sequence of collectives is the same on both.

Note: bucket phases
    A :class:`GradientBuckets` is in one :class:`BucketPhase` at a time::

        IDLE --begin--> ACCUMULATING --finish--> IDLE      (a micro-step that only sums)
        IDLE --begin--> REDUCING --finish--> IDLE          (reduced during backward)
                        REDUCING --finish--> DEFERRED --collect--> IDLE

    ``begin`` (the first gradient of a backward) picks ACCUMULATING or REDUCING from
    ``reduces_on(boundary)``; ``finish`` (the end of backward) launches what is left of a
    reducing micro-step or, for stages 0 and 1 without ``overlap_comm``, leaves the
    boundary's reductions DEFERRED until the optimizer step calls ``collect``. A new
    backward while DEFERRED is an error: the step has not consumed the boundary's
    gradients. ``_TRANSITIONS`` lists the legal moves and ``_move`` checks each one.
    Whether a stage-2 shard sum already holds a reduction in this accumulation window is
    not a phase: it is ``_reductions`` (micro-steps reduced into the shards since
    ``clear``), which only ``finish`` and ``clear`` change.
"""
from __future__ import annotations

import enum
from collections import deque
from typing import Callable, Optional, Sequence

import torch

from ..comm import Communicator
from ..errors import StateError
from ..core.flat import Block, FlatLayout

# In-flight asynchronous reductions before the oldest is waited for (bounds staging memory);
# without overlap_comm, stage 2 keeps one in flight (Note "releasing buckets" in buckets.py).
MAX_IN_FLIGHT = 2

# Told, during the boundary micro-step, that group g's reduced shard (the tensor) is final
# for this accumulation window: ``BucketedStage.record_reduced`` (stages/base.py).
OnRecordReduced = Callable[[int, torch.Tensor], None]


class BucketPhase(enum.Enum):
    """Where the buckets are in a micro-step (Note: bucket phases)."""

    IDLE = "idle"                  # no backward under way; nothing deferred
    ACCUMULATING = "accumulating"  # a backward is under way; its gradients are only summed
    REDUCING = "reducing"          # a backward is under way; its blocks are reduced now
    DEFERRED = "deferred"          # backward ended; the boundary's reductions wait for collect


_TRANSITIONS: dict[BucketPhase, frozenset[BucketPhase]] = {
    BucketPhase.IDLE: frozenset({BucketPhase.ACCUMULATING, BucketPhase.REDUCING}),
    BucketPhase.ACCUMULATING: frozenset({BucketPhase.IDLE}),
    BucketPhase.REDUCING: frozenset({BucketPhase.IDLE, BucketPhase.DEFERRED}),
    BucketPhase.DEFERRED: frozenset({BucketPhase.IDLE}),
}


class GradientBuckets:
    """Tracks gradient arrival per block and launches reductions in the fixed order.

    Without ``overlap`` the boundary's reductions may wait for :meth:`collect` (called by
    the optimizer step) when ``defer_without_overlap`` is set: stages 0 and 1 then hold only
    the full gradient after backward, as the ZeRO memory table assumes.

    ``on_reduced`` (given at construction, or None: nobody listens) is called once per group
    in the boundary micro-step, as the last of the group's blocks completes its reduction,
    with the group's reduced shard. A callback rather than records handed back by
    :meth:`finish` or :meth:`collect`, because what the receiver starts (the squared norm,
    the shard's copy to the host) must overlap the rest of backward: at ``finish`` it would
    be too late. Stage 0's all-reduce never calls it (its step reads the full sums).
    """

    defer_without_overlap = False
    # backwards only accumulate on this rank, for a later reducing one to take (stage 2's
    # buckets: Note "held backwards" in buckets.py); only ``begin`` reads it
    holding = False

    def __init__(self, layouts: Sequence[FlatLayout], comm: Communicator, *,
                 accum_dtype: torch.dtype, device: torch.device, overlap: bool,
                 comm_dtype: Optional[torch.dtype] = None,
                 reduce_scatter: Optional[Callable] = None,
                 on_reduced: Optional[OnRecordReduced] = None) -> None:
        self.layouts = list(layouts)
        self.comm = comm
        # how a block is reduce-scattered: over ``comm``, or a hierarchical plug-in with
        # the same signature (``hierarchy.py``: MiCS replicas, qgZ)
        self.reduce_scatter = reduce_scatter or comm.reduce_scatter
        self.accum_dtype = accum_dtype
        self.comm_dtype = comm_dtype or accum_dtype
        self.device = device
        self.overlap = overlap
        self.in_flight = MAX_IN_FLIGHT if overlap else 1
        self.order = [(g, b) for g, lay in enumerate(self.layouts) for b in lay.blocks][::-1]
        self._arrived: list[list[set[int]]] = [[set() for _ in lay.blocks]
                                               for lay in self.layouts]
        self._launched = [[False] * len(lay.blocks) for lay in self.layouts]
        self._next = 0
        self.phase = BucketPhase.IDLE   # Note: bucket phases
        self._at_boundary = False       # this micro-step ends the accumulation window
        self._pending: deque = deque()  # (work, on_done) of asynchronous reductions
        self._reductions = 0            # micro-steps reduced into the shards this window
        self._on_reduced = on_reduced
        # blocks of each group not yet reduced in the boundary micro-step
        self._blocks_left = [len(lay.blocks) for lay in self.layouts]

    # ------------------------------------------------------------ strategy hooks
    def reduces_on(self, boundary: bool) -> bool:
        """Whether this micro-step's gradients are reduced (vs only accumulated)."""
        raise NotImplementedError

    def _accumulate(self, g: int, block: Block, slot_index: int, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def _launch(self, g: int, block: Block) -> None:
        raise NotImplementedError

    def reduced_shard(self, g: int) -> torch.Tensor:
        """This rank's part of group g's gradient, summed over ranks (not yet averaged)."""
        raise NotImplementedError

    def exact_dtype(self, g: int) -> torch.dtype:
        """The narrowest dtype that holds group g's reduced shard without rounding: the
        communication dtype while the shard holds a single reduction (Note "communication
        dtype" in buckets.py), else the shard's own."""
        shard = self.reduced_shard(g)
        reductions = self._reductions + (1 if self.phase is BucketPhase.REDUCING else 0)
        if (reductions == 1 and self.comm_dtype.itemsize < shard.dtype.itemsize
                and self.comm_dtype.is_floating_point):
            return self.comm_dtype
        return shard.dtype

    @property
    def reductions_this_window(self) -> int:
        """Micro-steps reduced (or deferred to :meth:`collect`) since :meth:`clear`."""
        return self._reductions

    @property
    def reduced_this_window(self) -> bool:
        """Whether a micro-step of this accumulation window has been reduced (or deferred to
        :meth:`collect`) since :meth:`clear`."""
        return self._reductions > 0

    def clear(self) -> None:
        """Forget all gradients (after an optimizer step, applied or skipped)."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """The gradient buffers held now (for memory accounting)."""
        raise NotImplementedError

    def reduced_tensors(self) -> list[torch.Tensor]:
        """Of ``tensors()``, the reduced shard sums (DeepSpeed's ``lp_grads``); the others
        are accumulation and staging buffers (its ``contiguous_grad_buffer``)."""
        return []

    # ------------------------------------------------------------ the machinery
    def begin(self, boundary: bool) -> None:
        """Start a micro-step's backward (called implicitly by the first gradient)."""
        if self.active:
            return
        if self.phase is BucketPhase.DEFERRED:
            raise StateError("a new backward began before the optimizer step consumed the "
                             "accumulation boundary's gradients; call engine.step()")
        self._move(BucketPhase.REDUCING if self.reduces_on(boundary) and not self.holding
                   else BucketPhase.ACCUMULATING)
        self._at_boundary = boundary
        if boundary:
            self._blocks_left = [len(lay.blocks) for lay in self.layouts]
        self._next = 0
        for arrived, launched in zip(self._arrived, self._launched):
            for s in arrived:
                s.clear()
            launched[:] = [False] * len(launched)

    def add(self, g: int, slot_index: int, grad: torch.Tensor) -> None:
        """Take one parameter's gradient of this micro-step (from its backward hook)."""
        layout = self.layouts[g]
        block = layout.blocks[layout.slots[slot_index].block]
        if self._launched[g][block.index]:
            raise StateError(
                f"a parameter (group {g}, index {slot_index}) received a gradient after its "
                "bucket was reduced in this backward; call engine.backward once per micro-step")
        self._accumulate(g, block, slot_index, grad)
        self._arrived[g][block.index].add(slot_index)
        if self.phase is BucketPhase.REDUCING and (self.overlap
                                                   or not self.defer_without_overlap):
            self._launch_ready()   # Note "releasing buckets" in buckets.py

    def finish(self) -> None:
        """End the micro-step: launch what is left (in order) and wait for everything, or
        leave the boundary's reductions to :meth:`collect` (Note: bucket phases)."""
        if not self.active:
            return
        if self.phase is BucketPhase.ACCUMULATING:
            self._move(BucketPhase.IDLE)
            return
        # REDUCING. _reductions grows after the launches: until then exact_dtype counts
        # this micro-step through the phase.
        if self.defer_without_overlap and not self.overlap:
            self._reductions += 1
            self._move(BucketPhase.DEFERRED)
            return
        self._launch_rest()
        self._reductions += 1
        self._move(BucketPhase.IDLE)

    def collect(self) -> None:
        """Complete every reduction, including deferred ones; call before reading shards."""
        self.finish()
        if self.phase is BucketPhase.DEFERRED:
            self._move(BucketPhase.IDLE)
            self._launch_rest()

    def _launch_rest(self) -> None:
        while self._next < len(self.order):
            self._launch_next()
        self._drain(0)

    @property
    def active(self) -> bool:
        """Whether a micro-step's backward is under way."""
        return self.phase in (BucketPhase.ACCUMULATING, BucketPhase.REDUCING)

    def _move(self, to: BucketPhase) -> None:
        """Enter phase ``to``; raises StateError unless ``_TRANSITIONS`` allows the move."""
        if to not in _TRANSITIONS[self.phase]:
            came_from = [p.value for p, nxt in _TRANSITIONS.items() if to in nxt]
            raise StateError(f"gradient buckets are {self.phase.value}, expected "
                             f"{' or '.join(came_from)} to become {to.value}")
        self.phase = to

    def _launch_ready(self) -> None:
        while self._next < len(self.order):
            g, block = self.order[self._next]
            if len(self._arrived[g][block.index]) < len(block.slots):
                return
            self._launch_next()

    def _launch_next(self) -> None:
        g, block = self.order[self._next]
        self._next += 1
        self._launched[g][block.index] = True
        self._launch(g, block)

    def _reduced(self, g: int) -> None:
        """One block of group g has its final value for this micro-step; at the boundary,
        the group's last hands its reduced shard to ``on_reduced``."""
        if self._on_reduced is None or not self._at_boundary:
            return
        self._blocks_left[g] -= 1
        if not self._blocks_left[g]:
            self._on_reduced(g, self.reduced_shard(g))

    def _wire(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` in the communication dtype (itself when it already is)."""
        return flat if flat.dtype == self.comm_dtype else flat.to(self.comm_dtype)

    def _track(self, work, on_done: Optional[Callable[[], None]] = None) -> None:
        """Remember an async reduction; bound how many are in flight."""
        if work is None:
            if on_done is not None:
                on_done()
            return
        self._pending.append((work, on_done))
        self._drain(self.in_flight)

    def _drain(self, keep: int) -> None:
        while len(self._pending) > keep:
            work, on_done = self._pending.popleft()
            work.wait()
            if on_done is not None:
                on_done()
