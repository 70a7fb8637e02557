"""Launch plans: the host's stage-3 launches without headers, once the ranks agree on them.

Note: launch plans
    On the host every stage-3 collective waits for a header round trip first (Note "held
    reductions" in ``gather_check.py``): gloo aborts on gathers of different sizes, so
    nothing may launch before the ranks agree on it. On a small model that round trip costs
    more than the gather (docs/BENCHMARKS.md, "Divergence checks"). But training repeats
    itself: from one optimizer step to the next (a *cycle*: the forwards, backwards and the
    step) each rank launches the same unit gathers and gradient reduce-scatters, in the
    same order, as in the cycle before. So each rank records its cycle's launches (the
    unit of each gather, the size and dtype of each reduce-scatter) and folds a CRC-32 of
    that record into the step's collective trail, whose fingerprint the step's all-reduce
    already compares on every rank (Note "step fingerprint" in ``comm/trail.py``). When
    the step passes, every rank holds the same record; when it is also the record of the
    cycle before (a schedule that repeats: the first cycle, without a trace, differs from
    the second), it becomes the *plan* of the next cycle: a launch that is the plan's next goes out as it is, with no header and no held
    reduction, so a cycle that follows its plan adds nothing to the wire but the 4 bytes of
    CRC inside the step's fingerprint.

    A rank whose launch is not the plan's next (an extra forward, a skipped module, a
    changed schedule) notes that in its trail, then sends, in order, the collectives the
    plan still has up to the step: the planned units' gathers into scratch buffers (its
    own shards of them) and the planned reduce-scatters with zeros, and at the step the
    step's all-reduce with its fingerprint (``decoy_step``). Every other rank meets exactly
    what it launches, so none waits and none aborts; at the step's all-reduce the
    fingerprints differ and every rank raises RankDivergenceError, naming the first entry
    where the ranks differ (this rank's "left the plan" entry, with what it launched and
    what the plan had). Nothing is stepped. When every rank left the plan at the same
    point in the same way (the schedule changed for all: the first cycle with a trace, an
    evaluation, a checkpoint save between steps), the fingerprints agree: the ranks go on
    with headers (Note "held reductions") for the rest of the cycle. That costs one cycle
    of collectives, when a schedule that repeated itself changes; the next plan needs two
    equal cycles again.
"""
from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch

from ...comm import Communicator

GATHER, REDUCE, STEP_OP = "gather", "reduce-scatter", "step"


class LaunchPlan:
    """This rank's launches on one group in this cycle, and the cycle's agreed plan
    (Note: launch plans). ``decoy_gather(unit_index)`` sends a unit's gather into scratch;
    ``decoy_step()`` runs the step's all-reduce with the fingerprint (it raises when the
    ranks' trails differ); ``enabled()`` says whether plans may be used at this step."""

    def __init__(self, comm: Communicator, *, decoy_gather: Callable[[int], None],
                 decoy_step: Callable[[], None], enabled: Callable[[], bool],
                 describe_unit: Callable[[int], str]) -> None:
        self.comm = comm
        self._decoy_gather, self._decoy_step = decoy_gather, decoy_step
        self._enabled, self._describe_unit = enabled, describe_unit
        self.record: list[tuple] = []
        self.plan: Optional[list[tuple]] = None
        self._last: Optional[list[tuple]] = None   # the record of the cycle before
        self.cursor = 0
        self.left = 0   # cycles in which this rank left its plan (for tests and benches)

    def admit(self, op: tuple, actual: Callable[[], str]) -> bool:
        """Note ``op``, this rank's next launch (``actual()``: how it reads in an error).
        True: the plan has it next, launch it without a header. False: there is no plan
        (any more), launch it with one. When this rank left the plan and another did not,
        raises RankDivergenceError (from ``decoy_step``) on every rank."""
        if op[0] != STEP_OP:
            self.record.append(op)
        if self.plan is None:
            return False
        planned = self.plan[self.cursor]
        if planned == op:
            self.cursor += 1
            return True
        self._leave(actual)
        if op[0] == STEP_OP:
            return True   # the step's own all-reduce follows, as on the ranks that planned
        self._decoy_step()   # raises unless every rank left the plan here alike
        return False

    def leave_for(self, actual: str) -> None:
        """Before a collective that is no launch of a cycle (a checkpoint save or load):
        where a plan stands, leave it as :meth:`admit` does for a launch it does not have,
        sending what the others expect up to the step (raises RankDivergenceError unless
        every rank leaves it here alike). Not recorded: the cycle's record stays the
        launches of training."""
        if self.plan is None:
            return
        self._leave(lambda: actual)
        self._decoy_step()

    def _leave(self, actual: Callable[[], str]) -> None:
        assert self.plan is not None   # both callers return first where no plan stands
        planned = self.plan[self.cursor]
        self.left += 1
        self.comm.ledger.trail.note("left the plan", None,
                                    f"{actual()}, where the ranks' plan had "
                                    f"{self._describe(planned)}")
        remaining, self.plan = self.plan[self.cursor:-1], None
        for planned_op in remaining:
            self._send_in_place_of(planned_op)

    def end_cycle(self) -> None:
        """At the step, before its all-reduce: the cycle's record goes into the trail (and
        becomes the next plan once the step's fingerprints agree)."""
        record, self.record = self.record + [(STEP_OP,)], []
        crc = zlib.crc32(repr(record).encode())
        self.comm.ledger.trail.note("plan", len(record), f"{crc:08x}")
        # a schedule that repeated itself (the first cycle has no trace yet, so the second
        # differs from it): a plan that is left costs a cycle sent twice
        self.plan = record if self._enabled() and record == self._last else None
        self._last = record
        self.cursor = 0

    def forget(self) -> None:
        """The step failed: no plan stands."""
        self.plan, self.record, self.cursor, self._last = None, [], 0, None

    def _send_in_place_of(self, op: tuple) -> None:
        if op[0] == GATHER:
            self._decoy_gather(op[1])
            return
        numel, dtype = op[1], getattr(torch, op[2].split(".")[-1])
        world = self.comm.world_size
        self.comm.reduce_scatter(torch.empty(numel // world, dtype=dtype),
                                 torch.zeros(numel, dtype=dtype), label="left the plan")

    def _describe(self, op: tuple) -> str:
        if op[0] == GATHER:
            return f"a gather of {self._describe_unit(op[1])}"
        if op[0] == REDUCE:
            return f"a gradient reduce-scatter of {op[1]} elements"
        return "the optimizer step"


def use_launch_plans(stage, reduce_scatter) -> None:
    """Give the stage's host launches a plan where every collective of a cycle goes through
    them and the step's all-reduce is the stage's own (Note: launch plans): the host, plain
    gathers (not qwZ, hpZ, int8 frozen shards) and plain reduce-scatters (not MiCS, qgZ)."""
    from ..gradient_norm import _reduce_with_fingerprint
    from .wire import UnitWire
    host = stage.wire.host
    if not (stage._host_checked and reduce_scatter == host.reduce_scatter
            and type(stage.wire) is UnitWire and not stage.wire.quantized
            and all(unit.frozen is None for unit in stage.units)
            and stage.data_parallel_world in (None, stage.comm.world_size)):
        return

    def decoy_step() -> None:
        _reduce_with_fingerprint(torch.zeros(1, dtype=torch.float32), stage.comm, True)

    def decoy_gather(index: int) -> None:
        stage.wire.decoy(stage.units[index], label="left the plan")

    host.plan = LaunchPlan(stage.comm, decoy_gather=decoy_gather, decoy_step=decoy_step,
                           enabled=lambda: stage.grad_norm is None,
                           describe_unit=stage.wire.check.describe)
