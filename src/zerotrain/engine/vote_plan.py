"""Vote plans: stages 0-2 skip their position votes once the ranks agree on a cycle's.

Note: vote plans
    At stages 0-2 every backward that reduces, and every update, is voted on first (Note
    "backwards that reduce" in ``accumulation.py``): one all-reduce of six int64 and its
    read on the host, per event, beside collectives the step makes anyway. But training
    repeats itself: from one optimizer step to the next (a *cycle*) each rank casts the
    same votes (its micro-steps counted from the step before) and launches the same
    collectives between them, as in the cycle before. So each rank records its cycle: the
    vote it would cast at each event, and each collective (operation, size, dtype) any
    communicator on its ledger launches. At the step a CRC-32 of that record goes into the
    step's collective trail, whose fingerprint the gradient norm's all-reduce already
    compares on every rank (Note "step fingerprint" in ``comm/trail.py``). When the step
    passes, every rank holds the same record; when it is also the record of the cycle
    before, it becomes the *plan* of the next cycle: an event whose vote is the plan's next
    casts nothing, so a cycle that follows its plan adds no collective and no host read to
    the step, only the record's CRC inside the fingerprint it already sends.

    A rank whose vote is not the plan's next (an extra or a missing backward, a step on
    one rank, a checkpoint call on one rank) notes that in its trail, then sends, in order,
    the collectives the plan still has after the vote it replaces, each of the same size
    and dtype, of zeros (gradient reductions, the unused-parameter check), and then the
    step's all-reduce with its fingerprint. Every other rank meets exactly what it
    launches, so none waits and none aborts; at the step's all-reduce the fingerprints
    differ and every rank raises RankDivergenceError, naming the first entry where the
    ranks differ, this rank at the same time, before the event it was starting
    launched anything (the error is marked as a vote's verdict: the engine completes no
    backward it interrupted). When every rank left the plan at the same point in the same
    way (a checkpoint saved between steps, a schedule that changed for all), the
    fingerprints agree: the ranks vote again for the rest of the cycle, and the next plan
    needs two equal cycles again. What leaving costs is one cycle's collectives sent
    twice; what a plan saves is a vote per event. A record none of whose collectives
    after its first vote could be sent again in this way (a collective over another
    group, an object gather) makes no plan: those cycles vote.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Optional

import torch

from ..comm import Communicator
from ..comm.agreement import VERDICT

VOTE, STEP = "vote", "step"
SENT_AGAIN = ("all_reduce", "reduce_scatter", "all_gather")   # what a leaving rank sends


class VotePlan:
    """This rank's votes and collectives in this cycle, and the cycle's agreed plan (Note:
    vote plans). ``decoy_step()`` runs the step's all-reduce with the fingerprint (it
    raises when the ranks' trails differ); ``enabled()`` says whether plans may be used;
    ``describe(key)`` reads a vote's key in an error; ``position()`` is the engine's
    micro-step, which keys count from the last step."""

    def __init__(self, comm: Communicator, *, decoy_step: Callable[[], None],
                 enabled: Callable[[], bool], describe: Callable[[tuple], str],
                 position: Callable[[], int]) -> None:
        self.comm = comm
        self._decoy_step, self._enabled = decoy_step, enabled
        self._describe, self._position = describe, position
        self.record: list[tuple] = []
        self.plan: Optional[list[tuple]] = None
        self._last: Optional[list[tuple]] = None   # the record of the cycle before
        self.cursor = 0
        self.base = 0   # the micro-step of the last step: keys count from it
        self.left = 0   # cycles in which this rank left its plan (for tests and benches)
        comm.ledger.launches = self.note_launch
        comm.vote_plan = self

    def close(self) -> None:
        if self.comm.ledger.launches == self.note_launch:
            self.comm.ledger.launches = None
        if self.comm.vote_plan is self:
            self.comm.vote_plan = None

    # ------------------------------------------------------------------ recording
    def note_launch(self, comm: Communicator, op: str, tensor: Optional[torch.Tensor],
                    detail: str) -> None:
        """A collective launched on a communicator of this ledger (``Communicator._call``);
        a check's own (``detail`` "check": a vote, the fingerprint of a stage without a
        norm) is not part of a cycle: a planned cycle casts no vote."""
        if detail == "check":
            return
        if op in SENT_AGAIN and tensor is not None and comm.group is self.comm.group:
            self.record.append((op, tensor.numel(), tensor.dtype, tensor.device.type, detail))
        else:
            self.record.append(("other", op))

    def admit(self, key: tuple, actual: Callable[[], str]) -> bool:
        """Note this rank's vote ``key`` (``actual()``: how its values read in an error).
        True: the plan has it next, cast nothing. False: there is no plan (any more), cast
        the vote. When this rank left the plan and another did not, raises
        RankDivergenceError on every rank (Note: vote plans)."""
        entry = (VOTE, *key)
        self.record.append(entry)
        plan = self.plan
        if plan is None:
            return False
        planned = self._next_vote()
        if planned is not None and plan[planned] == entry:
            self.cursor = planned + 1
            return True
        self._leave(actual(), planned)
        return False

    def leave_for(self, actual: str) -> None:
        """Before a collective that is no event of a cycle (a checkpoint save or load):
        where a plan stands, leave it as :meth:`admit` does for a vote it does not have
        (raises RankDivergenceError unless every rank leaves it here alike). Not recorded."""
        if self.plan is not None:
            self._leave(actual, self._next_vote())

    def _next_vote(self) -> Optional[int]:
        assert self.plan is not None, "asked only while a plan stands"
        for index in range(self.cursor, len(self.plan)):
            if self.plan[index][0] == VOTE:
                return index
        return None

    def _leave(self, actual: str, planned: Optional[int]) -> None:
        plan, self.plan = self.plan, None
        assert plan is not None, "left only while a plan stands"
        self.left += 1
        had = (self._describe(plan[planned][1:]) if planned is not None
               else "the optimizer step")
        self.comm.ledger.trail.note("left the plan", None,
                                    f"{actual}, where the ranks' plan had {had}")
        rest = plan[planned + 1:] if planned is not None else plan[self.cursor:]
        try:
            for entry in rest:
                if entry[0] in SENT_AGAIN:
                    self._send_in_place_of(entry)
            self._decoy_step()   # raises unless every rank left the plan here alike
        except Exception as exc:
            setattr(exc, VERDICT, True)   # every rank stops here: launch nothing more
            self.comm.stopped_by_vote = exc
            raise

    def _send_in_place_of(self, entry: tuple) -> None:
        op, numel, dtype, device_type, detail = entry
        device = self.comm.device if device_type != "cpu" else torch.device("cpu")
        zeros = torch.zeros(numel, dtype=dtype, device=device)
        world = self.comm.world_size
        if op == "all_reduce":
            self.comm.all_reduce(zeros, op=detail, label="left the plan")
        elif op == "reduce_scatter":
            self.comm.reduce_scatter(torch.empty(numel // world, dtype=dtype, device=device),
                                     zeros, label="left the plan")
        else:
            self.comm.all_gather(torch.empty(numel, dtype=dtype, device=device),
                                 zeros[: numel // world], label="left the plan")

    # ------------------------------------------------------------------ the step
    def end_cycle(self) -> list[tuple]:
        """At the step, before its all-reduce: the cycle's record goes into the trail;
        returned, to become the next plan once the step's fingerprints agree (``adopt``)."""
        record, self.record = self.record + [(STEP,)], []
        crc = zlib.crc32(repr(record).encode())
        self.comm.ledger.trail.note("votes", len(record), f"{crc:08x}")
        self.base = self._position()
        return record

    def adopt(self, record: list[tuple]) -> None:
        """The step's fingerprints agreed: ``record`` is every rank's; a record that
        repeats the cycle before becomes the next cycle's plan."""
        self.plan = record if (record == self._last and self._enabled()
                               and _can_send_again(record)) else None
        self._last = record
        self.cursor = 0

    def forget(self) -> None:
        """The step failed: no plan stands."""
        self.plan, self._last, self.cursor = None, None, 0


def _can_send_again(record: list[tuple]) -> bool:
    """Whether a rank leaving this plan anywhere could send what it has after that point:
    a vote in it, and after its first vote only collectives :data:`SENT_AGAIN` covers."""
    votes = [i for i, entry in enumerate(record) if entry[0] == VOTE]
    return bool(votes) and all(entry[0] in SENT_AGAIN + (VOTE, STEP)
                               for entry in record[votes[0]:])


def vote_plan_for(engine: Any) -> Optional[VotePlan]:
    """A plan for an engine at stages 0-2 where every collective of a cycle goes over its
    one group and the step's all-reduce is the stage's own (not MiCS or qgZ reductions,
    tensor parallelism's norm, a traced world, one rank), else None."""
    from ..stages.gradient_norm import _reduce_with_fingerprint
    stage, comm = engine.stage, engine.comm
    buckets = stage.buckets
    if (stage.partitions_parameters or comm.world_size == 1 or not comm.carries_data
            or stage.comm is not comm
            or buckets.comm is not comm or buckets.reduce_scatter != comm.reduce_scatter
            or stage.data_parallel_world not in (None, comm.world_size)):
        return None
    sharded = stage.sharded

    def decoy_step() -> None:
        _reduce_with_fingerprint(torch.zeros(1, dtype=torch.float32, device=comm.device),
                                 comm, sharded, cycle=False)

    return VotePlan(comm, decoy_step=decoy_step,
                    enabled=lambda: stage.grad_norm is None,
                    describe=engine._describe_vote_key,
                    position=lambda: engine.micro_steps)
