"""When units are gathered and released: module hooks, the execution trace, prefetch.

Note: holders
    A unit is gathered while someone holds it: its own forward (pre-hook to post-hook), a
    module of another unit that depends on it, or its backward (from the moment the gradient
    of its forward output is computed until all its parameters have their gradients). The
    last holder to let go releases it. Whatever is still gathered when backward ends is
    released then, so nothing gathered outlives a micro-step's backward.

Note: trace and prefetch
    Every acquisition (unit, in forward or backward order) is recorded during a pass. From
    the next pass on, each acquisition is matched against the recorded order; while it
    matches, the next units of the trace are gathered ahead of use (asynchronously) up to
    ``prefetch_numel`` elements and within ``max_live_numel``. When the order differs (data
    dependent control flow), prefetching stops for the rest of the pass and the new order
    is recorded: results never depend on the trace, only the overlap does. Every rank takes
    the same decisions, so the collectives stay in the same order everywhere.

    After its forward, a unit that the trace says is used again within
    ``max_reuse_distance`` elements of other gathers (typically the last blocks, whose
    backward comes right away) is kept instead of released and re-gathered. The kept hold
    passes to that next use, a backward or another forward (a module called twice, or
    recomputed by activation checkpointing inside backward).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn

from .unit import Unit, UnitState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatherPolicy:
    """Stage-3 knobs, in elements (DeepSpeed's ``stage3_*`` keys)."""

    prefetch_numel: int
    max_live_numel: int
    max_reuse_distance: int


class UnitScheduler:
    def __init__(self, units: list[Unit], policy: GatherPolicy) -> None:
        self.units = units
        self.policy = policy
        self._trace: Optional[list[int]] = None
        self._recording: list[int] = []
        self._cursor = 0
        self._following = False
        self._kept: set[int] = set()
        self._backward_held: set[int] = set()
        self._arrived: dict[int, int] = {}
        self._needed = {u.spec.index: sum(p.requires_grad for p in u.spec.params)
                        for u in units}
        self.peak_live_numel = 0  # high-water mark of gathered (non-persistent) elements

    # ------------------------------------------------------------------ passes
    def begin_pass(self) -> None:
        """A forward of the whole model starts: adopt the last pass's order as the trace, and
        let go of units kept for a backward that never came (a forward without backward)."""
        for index in sorted(self._kept):
            self._let_go(index)
        self._kept.clear()
        if self._recording:
            self._trace, self._recording = self._recording, []
        self._cursor = 0
        self._following = self._trace is not None

    def end_backward(self) -> None:
        """Release everything still gathered; forget this micro-step's bookkeeping."""
        for unit in self.units:
            if not unit.spec.persistent and unit.state is not UnitState.RELEASED:
                unit.holders = 0
                unit.release()
        self._kept.clear()
        self._backward_held.clear()
        self._arrived.clear()

    # ------------------------------------------------------------------ forward
    def before_forward(self, index: int) -> None:
        self._record(index)
        if index in self._kept:
            self._kept.discard(index)  # the last forward's hold becomes this forward's
            self._prefetch()
        else:
            self._acquire(index)

    def after_forward(self, index: int) -> None:
        if torch.is_grad_enabled() and self._reused_soon(index):
            self._kept.add(index)
        else:
            self._let_go(index)

    # ------------------------------------------------------------------ backward
    def before_backward(self, index: int) -> None:
        if index in self._backward_held:
            return
        self._record(index)
        self._backward_held.add(index)
        if index in self._kept:
            self._kept.discard(index)  # the forward's hold becomes the backward's
            self._prefetch()
        else:
            self._acquire(index)

    def gradient_arrived(self, index: int) -> None:
        """One of the unit's parameters has its gradient of this micro-step."""
        self._arrived[index] = self._arrived.get(index, 0) + 1
        if self._arrived[index] == self._needed[index] and index in self._backward_held:
            self._backward_held.discard(index)
            self._let_go(index)

    # ------------------------------------------------------------------ machinery
    def _acquire(self, index: int) -> None:
        unit = self.units[index]
        for dep in sorted(unit.spec.deps):
            self._hold(self.units[dep])
        self._hold(unit)
        self._prefetch()
        for dep in sorted(unit.spec.deps):
            self.units[dep].finish_gather()
        unit.finish_gather()

    def _let_go(self, index: int) -> None:
        unit = self.units[index]
        for u in [unit] + [self.units[d] for d in sorted(unit.spec.deps)]:
            if u.spec.persistent:
                continue
            u.holders = max(0, u.holders - 1)
            if u.holders == 0:
                u.release()

    def _hold(self, unit: Unit) -> None:
        if unit.spec.persistent:
            return
        if unit.state is UnitState.RELEASED:
            self._start_gather(unit)
        unit.holders += 1

    def _start_gather(self, unit: Unit) -> None:
        unit.start_gather()
        self.peak_live_numel = max(self.peak_live_numel, self._live_numel())

    def _record(self, index: int) -> None:
        self._recording.append(index)
        if not self._following:
            return
        trace = self._trace
        if self._cursor < len(trace) and trace[self._cursor] == index:
            self._cursor += 1
        else:
            self._following = False
            logger.debug("stage 3: execution order differs from the trace at unit %d; "
                         "prefetch paused for this pass", index)

    def _upcoming(self) -> Iterator[int]:
        if self._following:
            yield from self._trace[self._cursor:]

    def _live_numel(self) -> int:
        return sum(u.numel for u in self.units
                   if not u.spec.persistent and u.state is not UnitState.RELEASED)

    def _prefetch(self) -> None:
        budget = self.policy.prefetch_numel
        live = self._live_numel()
        for index in self._upcoming():
            unit = self.units[index]
            if unit.state is not UnitState.RELEASED or unit.spec.persistent:
                continue
            if budget <= 0 or live + unit.numel > self.policy.max_live_numel:
                return
            self._start_gather(unit)
            budget -= unit.numel
            live += unit.numel

    def _reused_soon(self, index: int) -> bool:
        if not self._following:
            return False
        distance = 0
        seen: set[int] = set()
        for upcoming in self._trace[self._cursor:]:
            if upcoming == index:
                live = self._live_numel()
                return (distance < self.policy.max_reuse_distance
                        and live <= self.policy.max_live_numel)
            if upcoming not in seen:
                seen.add(upcoming)
                distance += self.units[upcoming].numel
        return False


def install_module_hooks(root: nn.Module, units: list[Unit],
                         scheduler: UnitScheduler) -> list[Any]:
    """Forward hooks on every unit's module; the root's pre-hook also starts a pass."""
    handles = [root.register_forward_pre_hook(lambda m, a: scheduler.begin_pass())]
    for unit in units:
        if unit.spec.persistent:
            continue
        index = unit.spec.index
        handles.append(unit.spec.module.register_forward_pre_hook(
            lambda m, a, i=index: scheduler.before_forward(i)))
        # always_call: a forward that raises still lets go of its unit (torch's checkpoint
        # ends a recomputation by raising inside the last operation that saves a tensor)
        handles.append(unit.spec.module.register_forward_hook(
            lambda m, a, out, i=index: _after_forward(scheduler, i, out), always_call=True))
    return handles


def _after_forward(scheduler: UnitScheduler, index: int, output: Any) -> None:
    scheduler.after_forward(index)
    if not torch.is_grad_enabled():
        return
    fired = []

    def on_grad(grad):
        if not fired:
            fired.append(True)
            scheduler.before_backward(index)
        return grad

    for tensor in _tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(on_grad)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors inside nested tuples, lists, dicts (model outputs) and dataclasses."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from _tensors(getattr(value, name, None))
