"""When units are gathered and released: module hooks, the execution trace, prefetch.

Note: holders
    A unit is gathered while someone holds it: its own forward (pre-hook to post-hook), a
    module of another unit that depends on it, or its backward (from the moment the gradient
    of its forward output is computed until every use of its parameters in backward is
    done). The unit counts its holders (``Unit.hold``, ``Unit.let_go``); the scheduler
    releases it when the last one lets go (``unit.py``, Note: freed storage). Whatever is
    still gathered when backward ends is released then (``Unit.drop_holders``), so nothing
    gathered outlives a micro-step's backward.

Note: end of a unit's backward
    Gradients of the trainable parameters are not enough to know that backward is done with
    a unit: a frozen parameter (a LoRA model's layer norm before a LoRA linear) is used to
    compute the gradient of the unit's input after the trainable ones have theirs. So the
    forward pre-hook registers a multi-gradient hook on the unit's inputs that require grad
    (``torch.autograd.graph.register_multi_grad_hook``); it runs once the gradients of all
    those inputs are computed, which is after every operation of the unit that backward
    runs. (FSDP2 passes the inputs through an identity autograd function instead, which
    forbids a forward that modifies its input in place.) A unit is released in backward
    when both happened: its trainable parameters have their gradients, and, if its forward
    had inputs that require grad, that hook ran. A unit with frozen parameters whose inputs
    need no gradient (the root unit, holding a LoRA model's final norm) has no such signal:
    its frozen parameters may still be needed to reach the trainable parameters of units
    that ran inside its forward (the blocks between its embedding and its final norm), so
    it stays gathered until backward ends. The hook that gathers a unit for backward sits on the node that made
    its output, whose pre-hooks run after the tensor hooks on that output: the unit after
    it in forward order is released before this one is gathered.

Note: entry points
    A unit is gathered by whichever of its modules runs first: the module that roots the unit,
    and every module that owns (or uses, as a tied or external parameter) one of its
    parameters. A per-unit depth counter makes only the outermost of nested calls gather
    and release, so a wrapper that calls a submodule (an embedding, ``generate`` of an inner
    model) directly sees its parameters gathered as the whole model's forward would.

Note: trace and prefetch
    Every acquisition (unit, in forward or backward order) is recorded during a pass. From
    the next pass on, each acquisition is matched against the recorded order; while it
    matches, the next units of the trace are gathered ahead of use (asynchronously) up to
    ``prefetch_numel`` elements and within ``max_live_numel``. When the order differs (data
    dependent control flow), prefetching stops for the rest of the pass and the new order
    is recorded: results never depend on the trace, only the overlap does. Every rank takes
    the same decisions, so the collectives stay in the same order everywhere. That holds
    while every rank records the same trace: each use is noted in the step's collective
    trail (Note "step fingerprint" in ``comm/trail.py``), so a rank that skipped a unit
    (whose gathers prefetch may have made anyway) is caught at that step, before its
    trace makes its next step's decisions differ. A forward without grad (evaluation)
    prefetches only within the trace's forward part: no backward follows to use the rest,
    and a unit gathered for it would hold its memory until the next pass.

    After its forward, a unit that the trace says is used again within
    ``max_reuse_distance`` elements of other gathers (typically the last blocks, whose
    backward comes right away) is kept instead of released and re-gathered. The kept hold
    passes to that next use, a backward or another forward (a module called twice, or
    recomputed by activation checkpointing inside backward).

Note: returned parameters
    A module may return one of its parameters (DeepSpeed's "external parameters": a linear
    returning its bias for the caller to add later). The units are planned from the
    parameters each module owns or registers (``unit_specs.py``), so nothing tells the
    plan that the caller uses the parameter after the module's forward, where its unit
    would be released and the caller would read an empty tensor; and the caller's own
    backward, which may have saved it, runs before the module's backward gathers the unit
    again. So the post-forward hook looks for parameters (or views of one) in the output
    and pins their unit (``pin``): it stays gathered until the micro-step's backward ends
    (or, for a forward without grad, until the next pass starts), whatever the caller does
    with it, an activation checkpoint's recomputation included. DeepSpeed likewise keeps
    such a parameter gathered; both register it in the caller's ``_external_params``
    (``usage.py``, Note: usage records), which records where it went and gathers nothing.
    A caller inside the unit's own forward (a block whose linear returns its bias for the
    block to add, Megatron's ``skip_bias_add``) pins nothing: a module of the unit is still
    in its forward (its depth, Note: entry points), or the unit is held for its backward
    (a recomputation inside it), and its forward and backward hold it for that use.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from .unit import Unit, UnitState
from .usage import UsageRecords, in_backward

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatherPolicy:
    """Stage-3 knobs, in elements (DeepSpeed's ``stage3_*`` keys)."""

    prefetch_numel: int
    max_live_numel: int
    max_reuse_distance: int


class UnitScheduler:
    """Decides when each unit is gathered and released, from the module hooks' calls
    (Note: entry points): it holds a unit while its forward, a dependent module or its
    backward needs it (Note: holders), records the order of the first pass and, following
    that trace, prefetches the next units within ``policy``'s limits. It also keeps the
    high-water marks of gathered elements that ``memory_breakdown`` reports.
    """

    def __init__(self, units: list[Unit], policy: GatherPolicy, *, usage: UsageRecords,
                 on_pass: Optional[Callable[[], None]] = None,
                 on_use: Optional[Callable[[int, bool], None]] = None) -> None:
        self.units = units
        self.policy = policy
        self.usage = usage   # DeepSpeed's usage records (usage.py), told of every move
        self._on_pass = on_pass   # told when a pass starts (the gather check counts them)
        # told of every use (unit, in backward): the step fingerprint covers the trace
        self._on_use = on_use
        self._trace: Optional[list[int]] = None
        self._recording: list[int] = []
        self._trace_forward = 0       # how many of the trace's entries are its forward's
        self._recording_forward: Optional[int] = None   # set when its backward begins
        self._cursor = 0
        self._following = False
        self._kept: set[int] = set()
        self._backward_held: set[int] = set()
        self._arrived: dict[int, int] = {}
        self._needed = {u.spec.index: sum(p.requires_grad for p in u.spec.params)
                        for u in units}
        self._expects_inputs: set[int] = set()   # Note: end of a unit's backward
        self._has_frozen = {u.spec.index for u in units
                            if any(not p.requires_grad for p in u.spec.params)}
        self._inputs_done: set[int] = set()
        self._depth = [0] * len(units)           # Note: entry points
        self._pinned: dict[int, bool] = {}       # Note: returned parameters (-> with grad)
        self._in_backward = False
        self.peak_live_numel = 0  # high-water mark of gathered (non-persistent) elements
        self.after_forward_numel = 0       # gathered when the last backward began
        self.peak_after_forward_numel = 0  # the highest of those

    # ------------------------------------------------------------------ passes
    def begin_pass(self) -> None:
        """A forward of the whole model starts: adopt the last pass's order as the trace, and
        let go of units kept for a backward that never came (a forward without backward),
        and of everything a backward that raised left gathered."""
        if self._on_pass is not None:
            self._on_pass()
        if self._in_backward and not in_backward():   # not a recomputation: it never ended
            self.end_backward()
        for index in sorted(self._kept):
            self.usage.unkept(index)
            self._let_go(index)
        self._kept.clear()
        for index, with_grad in sorted(self._pinned.items()):
            if not with_grad:   # no backward will read it: the last pass is over
                del self._pinned[index]
                self._let_go(index)
        if self._recording:
            forward = self._recording_forward
            self._trace_forward = len(self._recording) if forward is None else forward
            self._trace, self._recording = self._recording, []
        self._recording_forward = None
        self._cursor = 0
        self._following = self._trace is not None

    @property
    def has_trace(self) -> bool:
        """A pass's order is recorded and followed for prefetch (DeepSpeed's trace is not
        invalid)."""
        return self._trace is not None or bool(self._recording)

    def forget_trace(self) -> None:
        """Drop the recorded order (DeepSpeed's ``_invalidate_trace``): the next pass
        records it again and prefetches nothing meanwhile. Local; results never depend on
        the trace (Note: trace and prefetch)."""
        self._trace, self._recording = None, []
        self._recording_forward, self._cursor, self._following = None, 0, False

    def end_backward(self) -> None:
        """Release everything still gathered; forget this micro-step's bookkeeping."""
        for unit in self.units:
            if not unit.spec.persistent and unit.state is not UnitState.RELEASED:
                unit.drop_holders()
                unit.release()
        self._kept.clear()
        self._pinned.clear()
        self._backward_held.clear()
        self._arrived.clear()
        self._expects_inputs.clear()
        self._inputs_done.clear()
        self._in_backward = False
        self.usage.reset()

    # ------------------------------------------------------------------ forward
    def enter(self, index: int, module: nn.Module) -> bool:
        """``module`` of the unit starts its forward; the outermost (Note: entry points)
        gathers the unit and returns True."""
        self.usage.entered(index, module)
        if self._depth[index] == 0:
            self.before_forward(index)
        self._depth[index] += 1
        return self._depth[index] == 1

    def leave(self, index: int, module: nn.Module) -> bool:
        """``module`` of the unit ends its forward; the outermost lets go of the unit and
        returns True."""
        self.usage.left(index, module)
        self._depth[index] = max(0, self._depth[index] - 1)
        if self._depth[index]:
            return False
        self.after_forward(index, module)
        return True

    def before_forward(self, index: int) -> None:
        self._record(index)
        if index in self._kept:
            self._kept.discard(index)  # the last forward's hold becomes this forward's
            self.usage.unkept(index)
            self._prefetch()
        else:
            self._acquire(index)

    def after_forward(self, index: int, module: nn.Module) -> None:
        if torch.is_grad_enabled() and self._reused_soon(index):
            self._kept.add(index)
            if self._in_backward:   # a recomputation keeps it for the backward to come
                self.usage.kept_in_recompute(index, module)
        else:
            self._let_go(index)

    def pin(self, index: int, leaving: int) -> None:
        """A parameter of unit ``index`` is in the output of a module of unit ``leaving``
        (Note: returned parameters): keep the unit gathered (gather it if it is not) until
        backward ends, or the next pass starts when no backward can follow."""
        if self._depth[index] > (1 if index == leaving else 0) or index in self._backward_held:
            return   # used inside the unit's own forward or backward: they hold it already
        with_grad = torch.is_grad_enabled()
        if index in self._pinned:
            self._pinned[index] = self._pinned[index] or with_grad
            return
        self._pinned[index] = with_grad
        self._acquire(index)

    def expect_inputs_backward(self, index: int) -> None:
        """The unit's forward had inputs that require grad (Note: end of a unit's backward)."""
        self._expects_inputs.add(index)

    # ------------------------------------------------------------------ backward
    def before_backward(self, index: int, module: nn.Module) -> None:
        """The gradient of ``module``'s output (a module of the unit) arrived: the unit's
        backward starts."""
        self.usage.backward_began(index, module)
        if not self._in_backward:   # forward is over: what is gathered now stays till backward
            self._in_backward = True
            if self._recording_forward is None:
                self._recording_forward = len(self._recording)
            self.after_forward_numel = self._live_numel()
            self.peak_after_forward_numel = max(self.peak_after_forward_numel,
                                                self.after_forward_numel)
        if index in self._backward_held:
            return
        self._record(index)
        self._backward_held.add(index)
        self._inputs_done.discard(index)
        if index in self._kept:
            self._kept.discard(index)  # the forward's hold becomes the backward's
            self.usage.unkept(index)
            self._prefetch()
        else:
            self._acquire(index)

    def gradient_arrived(self, index: int) -> None:
        """One of the unit's parameters has its gradient of this micro-step."""
        self._arrived[index] = self._arrived.get(index, 0) + 1
        self._maybe_done(index)

    def inputs_backward_done(self, index: int) -> None:
        """The gradients of the unit's inputs are computed (Note: end of a unit's backward)."""
        self._inputs_done.add(index)
        self._maybe_done(index)

    def _maybe_done(self, index: int) -> None:
        if index not in self._expects_inputs and index in self._has_frozen:
            return   # Note: end of a unit's backward (frozen, no inputs): held to the end
        if (index in self._backward_held
                and self._arrived.get(index, 0) >= self._needed[index]
                and (index not in self._expects_inputs or index in self._inputs_done)):
            self._backward_held.discard(index)
            self.usage.backward_done(index)
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
            if u.let_go():
                u.release()

    def _hold(self, unit: Unit) -> None:
        if unit.spec.persistent:
            return
        if unit.state is UnitState.RELEASED:
            self._start_gather(unit)
        unit.hold()

    def _start_gather(self, unit: Unit) -> None:
        unit.start_gather()
        self.peak_live_numel = max(self.peak_live_numel, self._live_numel())

    def _record(self, index: int) -> None:
        if len(self._recording) > 8 * len(self.units) + 64:
            # no pass is being delimited (only submodules are called, as by a wrapper's
            # generate): stop recording rather than grow, and stop following the trace
            self._recording.clear()
            self._recording_forward = None
            self._trace, self._following = None, False
        self._recording.append(index)
        if self._on_use is not None:
            self._on_use(index, self._in_backward)
        if not self._following:
            return
        trace = self._trace
        assert trace is not None   # following means a trace: both change together
        if self._cursor < len(trace) and trace[self._cursor] == index:
            self._cursor += 1
        else:
            self._following = False
            logger.debug("stage 3: execution order differs from the trace at unit %d; "
                         "prefetch paused for this pass", index)

    def _upcoming(self) -> Iterator[int]:
        """The trace's next units; without grad (evaluation) only its forward's, since no
        backward follows to use the others."""
        if self._following:
            trace = self._trace
            assert trace is not None   # following means a trace: both change together
            end = len(trace) if torch.is_grad_enabled() else self._trace_forward
            yield from trace[self._cursor:end]

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
        trace = self._trace
        assert trace is not None   # following means a trace: both change together
        distance = 0
        seen: set[int] = set()
        for upcoming in trace[self._cursor:]:
            if upcoming == index:
                live = self._live_numel()
                return (distance < self.policy.max_reuse_distance
                        and live <= self.policy.max_live_numel)
            if upcoming not in seen:
                seen.add(upcoming)
                distance += self.units[upcoming].numel
        return False
