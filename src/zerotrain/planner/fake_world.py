"""Rank 0 of a fake world: torch's fake process group under ``FakeTensorMode``.

The fake process group carries no data, and the communicator knows it (Note "a traced
world" in ``comm/communicator.py``): an ``all_gather_object`` answers this rank's object for
every rank, and the checks that compare ranks (the step fingerprint, the stage-3 gather
headers) have nobody to disagree with. One thing is adapted for fake tensors, local to
:func:`fake_world`: ``Module.to`` that changes nothing returns the module as it is (torch
swaps fake parameters otherwise, which the fake mode's own references forbid); the model is
built in the training dtype so that no cast is left to do.

Note: the backend's own buffers
    A fake collective completes at once and allocates nothing, but a real backend may hold
    memory of its own while a collective is in flight. Gloo (the host) runs a
    reduce-scatter as an all-reduce of a copy of the whole input and cuts this rank's part
    out of it when the work is waited for: a second buffer of the gradient bucket's size,
    alive from the launch to the wait. At stages 1-3 that copy is what made the traced peak
    of a CPU run up to 11% low (the staging bucket, its copy and the backward's own
    products alive together). ``StepSpec.backend="gloo"`` makes the fake world's
    reduce-scatter hold such a copy until its wait; NCCL (the default) reduces in place
    from the input, and what it allocates itself is not the caching allocator's.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch

from ..estimate.peak import PeakTracker
from .spec import BACKENDS


class _HeldCopy:
    """A collective's work that keeps the backend's copy of its input until it is waited
    for (Note: the backend's own buffers)."""

    __slots__ = ("_work", "_copy")

    def __init__(self, work: Any, held: torch.Tensor) -> None:
        self._work, self._copy = work, held

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        self._copy = None
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _copying_reduce_scatter(reduce_scatter: Callable) -> Callable:
    """``reduce_scatter`` as gloo runs it: on a copy of the input, alive until the wait."""
    def launch(output, input, group=None, async_op=False, **kwargs):
        held = input.clone()
        work = reduce_scatter(output, input, group=group, async_op=async_op, **kwargs)
        return _HeldCopy(work, held) if async_op else work
    return launch


class _CountedCopy:
    """A real gloo reduce-scatter's work, its copy of the input counted by a tracker from
    the launch until the wait begins (from there the tracker sees the buffer itself: the
    wait cuts this rank's part out of it)."""

    __slots__ = ("_work", "_tracker", "_key")

    def __init__(self, work: Any, tracker: PeakTracker, nbytes: int) -> None:
        self._work, self._tracker, self._key = work, tracker, ("gloo copy", id(self))
        tracker.hold(self._key, nbytes)

    def wait(self, *args, **kwargs):
        self._tracker.release(self._key)
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work.is_completed()


@contextlib.contextmanager
def counting_gloo_copies(tracker: PeakTracker) -> Iterator[None]:
    """For a measurement on real gloo ranks: count each asynchronous reduce-scatter's copy
    of its input (Note: the backend's own buffers), which gloo makes in C++ where no
    dispatch mode sees it, from its launch. Measured by the process's resident memory: a
    200 MB reduce-scatter on 2 gloo ranks adds 200 MB at the launch, freed with its work."""
    from ..comm import communicator

    saved = communicator._reduce_scatter

    def launch(output, input, group=None, async_op=False, **kwargs):
        work = saved(output, input, group=group, async_op=async_op, **kwargs)
        if not async_op:
            return work
        return _CountedCopy(work, tracker, input.numel() * input.element_size())
    communicator._reduce_scatter = launch
    try:
        yield
    finally:
        communicator._reduce_scatter = saved


@contextlib.contextmanager
def fake_world(rank: int, world: int, backend: str = "nccl") -> Iterator[Any]:
    """Rank ``rank`` of ``world`` over torch's fake process group, under ``FakeTensorMode``
    (both undone on exit), its collectives holding what ``backend``'s would (Note: the
    backend's own buffers); yields the mode."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..comm import communicator

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if dist.is_initialized():
        raise RuntimeError("the planner needs a process without a process group (it runs "
                           "rank 0 of a fake one)")
    saved_apply, saved_scatter = torch.nn.Module._apply, communicator._reduce_scatter

    def apply(self, fn: Callable, recurse: bool = True):
        with torch.no_grad():
            if all(fn(t) is t for t in list(self.parameters()) + list(self.buffers())):
                return self
        return saved_apply(self, fn, recurse)

    env = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK")}
    os.environ.update(LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", LOCAL_RANK=str(rank))
    torch.nn.Module._apply = apply
    if backend == "gloo":
        communicator._reduce_scatter = _copying_reduce_scatter(saved_scatter)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        # the subgroups made from this world die with it; a later world may reuse its id()
        # (the cache's key), and would then be handed a group torch no longer knows
        dead = id(dist.group.WORLD)
        for key in [k for k in communicator._SUBGROUPS if k[0] == dead]:
            del communicator._SUBGROUPS[key]
        dist.destroy_process_group()
        torch.nn.Module._apply = saved_apply
        communicator._reduce_scatter = saved_scatter
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _FakeTracker(PeakTracker):
    """A :class:`PeakTracker` for fake tensors: a scalar read (``.item()``: the gradient
    norm, the overflow check) has no data to read, so it answers 1.0 (0 for integers, False
    for booleans): no overflow, a unit norm. The step's allocations are assumed not to depend
    on those values (docs/BENCHMARKS.md says how close fake and real steps come)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return False if dtype is torch.bool else (1.0 if dtype.is_floating_point else 0)
        return super().__torch_dispatch__(func, types, args, kwargs)
