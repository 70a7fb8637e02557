"""The accumulation window: what the engine knows of the micro-steps since the last update.

Why a module of its own: whether a backward ran in this window, whether it stayed on this
rank (``no_sync``), which call took the last update, whether ``step()`` is running, a
drop that ``optimizer.zero_grad()`` asked for... are read by the engine's backward and
step, by ``optimizer.step()``, by the gradient readers and by checkpoints. One object holds
them, and its transitions are their only writer, each allowed only in the phases of a table.

Note: the window's phases
    The engine moves the window through :class:`Phase` by events (the methods of
    :class:`AccumulationWindow`); ``TRANSITIONS`` maps each allowed (phase, event) to
    the next phase. An event the table does not list for the current phase is an order a
    training loop cannot produce (an update from a backward hook, a second ``step()``
    inside the first): it raises StateError naming the call and the phase, before the
    window changes. The refusals a user meets in a loop (a step inside
    ``coalesce_grad_reduction()``, an update without a backward, ``no_sync`` at stage 2)
    stay where they are, with their own errors; they run before the window is asked,
    so the table is a second guard, not the first. Each target is fixed, so where the
    next phase depends on where the window was, the phase says it: a backward inside
    ``coalesce_grad_reduction()`` (BLOCK_BACKWARD, BLOCK_FAILED) ends back in the block,
    one outside it in MICRO_STEP; a step that took the update (UPDATED) ends in STEPPED,
    one that did not (BOUNDARY) in MICRO_STEP. ``coalescing`` and ``in_step`` are read off
    the phase.

    A direct ``loss.backward()`` that raises leaves no trace the engine sees at once
    (Note "a direct backward that raises" in ``direct_backward.py``); the engine's next
    ``forward``, ``backward`` or ``step`` ends it. Until then the window is BACKWARD, and
    any other event first asks ``backward_raised`` (the engine's probe): where the
    backward is over, the window moves to FAILED, where what a loop does after catching
    the error (leave a ``no_sync`` block, ``zero_grad``, load a checkpoint) is allowed.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Callable, Optional

from ..errors import StateError

if TYPE_CHECKING:
    from ..stages.base import StepOutcome

__all__ = ["AccumulationWindow", "EVENTS", "Phase", "TRANSITIONS"]


class Phase(enum.Enum):
    """Where the window is; each value says it as an error message does."""

    MICRO_STEP = "between backwards"
    BACKWARD = "during a backward"
    FAILED = "after a backward that raised, before the engine ended it"
    COALESCING = "inside coalesce_grad_reduction()"
    BLOCK_BACKWARD = "during a backward inside coalesce_grad_reduction()"
    BLOCK_FAILED = ("after a backward that raised inside coalesce_grad_reduction(), before "
                    "the engine ended it")
    BOUNDARY = "while step() runs"
    UPDATED = "while step() finishes the update it took"
    STEPPED = "after the update, before any backward or step()"


_P = Phase
# phases without a backward or a step running, outside a block / anywhere but a backward
_IDLE = (_P.MICRO_STEP, _P.STEPPED)
_SETTLED = (*_IDLE, _P.COALESCING, _P.FAILED, _P.BLOCK_FAILED)


def _same(*phases: Phase) -> dict[Phase, Phase]:
    return {phase: phase for phase in phases}


# event -> {phase it may come in: the phase it leads to} (Note: the window's phases)
_BY_EVENT: dict[str, dict[Phase, Phase]] = {
    "begin_backward": {_P.MICRO_STEP: _P.BACKWARD, _P.STEPPED: _P.BACKWARD,
                       _P.COALESCING: _P.BLOCK_BACKWARD},
    "end_backward": {_P.BACKWARD: _P.MICRO_STEP, _P.FAILED: _P.MICRO_STEP,
                     _P.BLOCK_BACKWARD: _P.COALESCING, _P.BLOCK_FAILED: _P.COALESCING},
    "fail_backward": {_P.BACKWARD: _P.FAILED, _P.FAILED: _P.FAILED,
                      _P.BLOCK_BACKWARD: _P.BLOCK_FAILED, _P.BLOCK_FAILED: _P.BLOCK_FAILED},
    "abandon_backward": {_P.FAILED: _P.MICRO_STEP, _P.BLOCK_FAILED: _P.COALESCING},
    "enter_no_sync": _same(*_IDLE, _P.FAILED),
    "leave_no_sync": _same(*_IDLE, _P.FAILED),
    "enter_coalescing": {_P.MICRO_STEP: _P.COALESCING, _P.STEPPED: _P.COALESCING,
                         _P.FAILED: _P.BLOCK_FAILED},
    "leave_coalescing": {_P.COALESCING: _P.MICRO_STEP, _P.BLOCK_FAILED: _P.FAILED},
    "begin_step": {_P.MICRO_STEP: _P.BOUNDARY, _P.STEPPED: _P.BOUNDARY},
    "took_update": {_P.BOUNDARY: _P.UPDATED, _P.MICRO_STEP: _P.STEPPED},
    "end_step": {_P.BOUNDARY: _P.MICRO_STEP, _P.UPDATED: _P.STEPPED},
    "end_micro_step": _same(*_IDLE),
    "drop_window": _same(_P.BOUNDARY, _P.MICRO_STEP),
    "reduced_local": _same(*_IDLE, _P.BOUNDARY, _P.FAILED, _P.COALESCING),
    "zero_grad": _same(*_SETTLED),
    "request_drop_at_backward": _same(*_SETTLED),
    "set_boundary_override": _same(*_SETTLED),
    "reset_after_load": {**_same(*_SETTLED), _P.STEPPED: _P.MICRO_STEP},
    "set_lr_step_due": _same(_P.UPDATED),
    "take_lr_step_due": _same(*_SETTLED, _P.BOUNDARY, _P.UPDATED),
}

TRANSITIONS: dict[tuple[Phase, str], Phase] = {
    (phase, event): after for event, moves in _BY_EVENT.items()
    for phase, after in moves.items()}
EVENTS: tuple[str, ...] = tuple(_BY_EVENT)


class AccumulationWindow:
    """The engine's accumulation-window state; every write is a transition (Note: the
    window's phases). Fields are read freely; only this class assigns them."""

    __slots__ = ("phase", "step_applied", "lr_step_due", "backward_in_window", "updated_by",
                 "drop_grads_at_backward", "inside_no_sync", "local_backwards",
                 "boundary_override", "window_backwards", "micro_backwards", "last_outcome",
                 "_backward_raised")

    def __init__(self, *, backward_raised: Optional[Callable[[], bool]] = None) -> None:
        self.phase = Phase.MICRO_STEP
        self.step_applied = False          # by the latest step() (False between boundaries)
        self.lr_step_due: Optional[dict] = None   # delayed update: the scheduler step to take
        self.backward_in_window = False    # a backward ended since the last update or zero_grad
        self.updated_by: Optional[str] = None   # which call took the last update
        self.drop_grads_at_backward = False   # optimizer.zero_grad() since the last backward
        self.inside_no_sync = False        # DeepSpeed's inside_no_sync_ctxt (Note: no_sync)
        self.local_backwards = 0           # no_sync backwards no reduction has taken yet
        self.boundary_override: Optional[bool] = None   # set_gradient_accumulation_boundary
        self.window_backwards = 0          # since the last update (unmanaged global_samples)
        self.micro_backwards = 0           # since the micro-step's end or update (votes)
        self.last_outcome: Optional[StepOutcome] = None   # the last update's
        # whether the backward the window counts as running is over without its end (a
        # direct loss.backward() that raised): the engine's probe
        self._backward_raised = backward_raised

    # ------------------------------------------------------------------ derived
    @property
    def coalescing(self) -> bool:
        """Inside ``coalesce_grad_reduction()``."""
        return self.phase in (Phase.COALESCING, Phase.BLOCK_BACKWARD, Phase.BLOCK_FAILED)

    @property
    def in_step(self) -> bool:
        """``step()`` is running: in unmanaged mode, the accumulation boundary."""
        return self.phase in (Phase.BOUNDARY, Phase.UPDATED)

    def expect(self, event: str, call: str) -> None:
        """Raise StateError now where ``event`` could not come next (before work that the
        event would only record afterwards); a backward found over moves to FAILED."""
        self._next(event, call)

    def _next(self, event: str, call: str) -> Phase:
        if (self.phase in (Phase.BACKWARD, Phase.BLOCK_BACKWARD)
                and event not in ("end_backward", "fail_backward")
                and self._backward_raised is not None and self._backward_raised()):
            self.phase = TRANSITIONS[(self.phase, "fail_backward")]   # the probe's transition
        after = TRANSITIONS.get((self.phase, event))
        if after is None:
            allowed = ", ".join(p.name for p in Phase if (p, event) in TRANSITIONS)
            raise StateError(
                f"{call} {self.phase.value} (phase {self.phase.name}): the accumulation "
                f"window takes it only in phase {allowed}; a call from a hook or callback "
                "while the engine runs a backward or a step is the usual cause "
                "(Note \"the window's phases\" in zerotrain/engine/window.py)")
        return after

    def _move(self, event: str, call: str) -> None:
        """The one gate of every write: the table's next phase, or StateError."""
        self.phase = self._next(event, call)

    # ------------------------------------------------------------------ backward
    def begin_backward(self, call: str = "engine.backward()") -> None:
        """The backward's prologue passed: its gradients are about to arrive."""
        self._move("begin_backward", call)

    def end_backward(self, *, boundary: bool, call: str = "the end of a backward") -> None:
        """Every gradient of the backward arrived (or a failed one was ended as complete).
        ``boundary``: it ends the accumulation window."""
        self._move("end_backward", call)
        self.backward_in_window = True
        self.window_backwards += 1
        self.micro_backwards += 1   # Note "backwards that reduce" in accumulation.py
        self.updated_by = None
        local = self.inside_no_sync
        if local or boundary:   # a boundary backward outside no_sync reduces them all
            self.local_backwards = self.local_backwards + 1 if local else 0

    def fail_backward(self, call: str = "a backward that raised") -> None:
        """The running backward raised; the engine ends it (``end_backward``) or, where a
        vote stopped the ranks, abandons it."""
        self._move("fail_backward", call)

    def abandon_backward(self, call: str = "a backward stopped by a vote") -> None:
        """A failed backward left as it stopped: nothing of it is ended or counted (a vote
        stopped every rank, or an interrupt)."""
        self._move("abandon_backward", call)

    # ------------------------------------------------------------------ contexts
    def enter_no_sync(self) -> bool:
        """``no_sync()`` begins; returns the outer state, which :meth:`leave_no_sync`
        restores (nesting is allowed)."""
        self._move("enter_no_sync", "engine.no_sync()")
        outer, self.inside_no_sync = self.inside_no_sync, True
        return outer

    def leave_no_sync(self, outer: bool) -> None:
        self._move("leave_no_sync", "the exit of engine.no_sync()")
        self.inside_no_sync = outer

    def enter_coalescing(self) -> None:
        self._move("enter_coalescing", "engine.coalesce_grad_reduction()")
        self.inside_no_sync = True

    def leave_coalescing(self) -> None:
        self._move("leave_coalescing", "the exit of coalesce_grad_reduction()")
        self.inside_no_sync = False

    def reduced_local(self, call: str = "a reduction of the local gradients") -> None:
        """What backwards kept on this rank went over the ranks."""
        self._move("reduced_local", call)
        self.local_backwards = 0

    # ------------------------------------------------------------------ step and update
    def begin_step(self) -> None:
        """``engine.step()`` runs: nothing applied yet; in unmanaged mode, the boundary."""
        self._move("begin_step", "engine.step()")
        self.step_applied = False

    def end_step(self) -> None:
        self._move("end_step", "the end of engine.step()")

    def end_micro_step(self) -> None:
        self._move("end_micro_step", "the end of a micro-step")
        self.micro_backwards = 0

    def took_update(self, call: str, outcome: StepOutcome) -> None:
        """``call`` (``engine.step()`` or ``optimizer.step()``) ran the stage's update."""
        self._move("took_update", call)
        self.last_outcome = outcome
        self.step_applied = outcome.applied
        self.backward_in_window = False
        self.window_backwards = self.micro_backwards = 0
        self.updated_by = call

    def drop_window(self, call: str) -> None:
        """The update refused after the gradients were dropped: the window starts afresh."""
        self._move("drop_window", call)
        self.backward_in_window = False
        self.window_backwards = self.micro_backwards = 0

    def set_lr_step_due(self, lr_kwargs: dict) -> None:
        """A delayed update still reads the current lr: the scheduler steps at settle."""
        self._move("set_lr_step_due", "a delayed update's scheduler step")
        self.lr_step_due = lr_kwargs

    def take_lr_step_due(self) -> Optional[dict]:
        self._move("take_lr_step_due", "engine.settle()")
        due, self.lr_step_due = self.lr_step_due, None
        return due

    # ------------------------------------------------------------------ the caller's
    def zero_grad(self, call: str = "engine.zero_grad()") -> None:
        """The accumulated gradients were dropped."""
        self._move("zero_grad", call)
        self.backward_in_window = False
        self.local_backwards = 0
        self.drop_grads_at_backward = False

    def request_drop_at_backward(self) -> None:
        """``optimizer.zero_grad()``: the next backward drops the gradients first."""
        self._move("request_drop_at_backward", "optimizer.zero_grad()")
        self.drop_grads_at_backward = True

    def set_boundary_override(self, is_boundary: bool) -> None:
        self._move("set_boundary_override", "engine.set_gradient_accumulation_boundary()")
        self.boundary_override = is_boundary

    def reset_after_load(self) -> None:
        """A checkpoint was loaded: a fresh window (the last update's outcome forgotten)."""
        self._move("reset_after_load", "engine.load_checkpoint()")
        self.backward_in_window = False
        self.local_backwards = 0
        self.last_outcome = None
        self.step_applied = False
        self.window_backwards = self.micro_backwards = 0
