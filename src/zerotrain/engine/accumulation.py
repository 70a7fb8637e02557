"""Which backwards reduce: the engine's ``no_sync()`` and ``coalesce_grad_reduction()``,
and ``managed_gradient_accumulation: false``, where the caller's ``step()`` ends the window.

Why a module of its own: the two contexts only say whether the backwards inside keep their
gradients on this rank; the engine's ``backward`` and ``step`` read that (the accumulation
window's ``inside_no_sync`` and ``local_backwards``, ``window.py``) and refuse a step that
would use one rank's gradients. Kept apart, as a mixin :class:`~zerotrain.engine.ZeroEngine`
inherits, the rules are in one place with their Note.

Note: no_sync
    At stages 0 and 1 each rank accumulates the full gradient and one backward reduces it:
    the one that ends the accumulation window. Inside ``no_sync()`` a backward only
    accumulates, even at the boundary, and the window's next backward outside it reduces
    the whole sum; so a loop that wraps all but a window's last backward in ``no_sync`` ends
    bit for bit where it would without it. The loss is still divided by
    ``gradient_accumulation_steps`` (DeepSpeed stops dividing inside ``no_sync``). A step at
    the boundary inside ``no_sync``, or after a ``no_sync`` backward that no reducing
    backward has followed, raises StateError instead of updating with one rank's
    gradients; ``step()`` at other micro-steps only counts them. Stages 2 and 3 reduce-scatter
    every backward's gradients into shards, so there ``no_sync`` refuses, as DeepSpeed's
    does. Nesting ``no_sync`` in ``no_sync`` is allowed (leaving the inner context restores
    the outer state, as with DDP's ``no_sync``; DeepSpeed refuses re-entry); ``no_sync``
    inside ``coalesce_grad_reduction()`` and the reverse are refused, as in DeepSpeed: the
    block's exit is its one reduction, and an inner context would change which backwards
    it covers.

Note: unmanaged accumulation
    With ``managed_gradient_accumulation: false`` (DeepSpeed 0.19) the caller owns the
    accumulation window: every ``step()`` ends it and applies an update, however many
    backwards came before, and ``is_gradient_accumulation_boundary()`` is True only while
    ``step()`` runs. ``backward()`` still divides the loss by
    ``gradient_accumulation_steps`` (unless ``scale_wrt_gas=False``), as DeepSpeed's does,
    so N backwards and one step equal the managed loop with ``gradient_accumulation_steps``
    N, bit for bit. No backward ends the window, so at stages 0 and 1 each one only
    accumulates on its rank, and the update (``engine.step()``, or ``optimizer.step()``)
    reduces the sum once, with one reducing empty backward, as leaving
    ``coalesce_grad_reduction()`` does; ``no_sync()`` changes nothing there. Stages 2 and 3
    reduce-scatter every backward anyway, so the update only applies it.
    ``global_samples`` grows by the backwards actually run (``train_batch_size /
    gradient_accumulation_steps`` samples each), ``micro_steps`` by one per ``step()``.
    Refused, naming why: ``set_gradient_accumulation_boundary()`` and
    ``coalesce_grad_reduction()`` (each would own the boundary too), ``overlap_comm`` at
    stages 0-1 (nothing to overlap; ``config/checks.py``), and, as in managed mode, an
    update with no backward since the last one, or inside ``no_sync()``.

    Ranks must run as many backwards before each update: stage 2 reduce-scatters in each
    one, and a rank's extra backward would meet its peers' step (gloo aborts the process;
    NCCL hangs). So in this mode the ranks agree first, with one vote (Note "position
    votes" in ``comm/agreement.py``: each rank's event, a backward or an update, and its
    backwards so far in the window), before each update and, at stage 2, before each
    backward, and every rank raises RankDivergenceError naming what each rank was doing.
    The cost: that all-reduce per update, and per backward at stage 2, its verdict read at
    the next launch (Note "deferred verdicts" in ``comm/agreement.py``). Stage 3 needs none: every forward gathers units and every step sends a
    header, which already stop every rank at the first difference (Note "held
    reductions" in ``zero3/gather_check.py``), and a vote of its own would meet a peer's
    gather there instead.

Note: backwards that reduce
    The same holds with the engine counting micro-steps. At stage 2 every backward
    reduce-scatters its gradients as its buckets fill, and at stages 0-1 the backward that
    ends the accumulation window reduces them (or, without ``overlap_comm``, refuses a
    second backward before the step): a rank that runs one backward more than its peers (a
    loss on one rank only) would pair its reductions with the peers' next backward or step,
    or stop alone, before the step's fingerprint (Note "step fingerprint" in
    ``comm/trail.py``) could compare (gloo aborts the process; NCCL hangs or sums
    mismatched buffers). So on more than one rank, at stages 0-2, every backward that will
    reduce (``engine.backward`` or a direct ``loss.backward()``: both start with the
    engine's prologue, before the first gradient exists; at stage 1 the exit of a
    ``coalesce_grad_reduction()`` block, whose one reduction is the one its last backward
    would have launched without the block, so it votes as that backward, and a rank that
    ran the window in the block agrees with peers that did not, as their collectives do)
    and every update is voted on first (Note "position votes" in ``comm/agreement.py``): (backward or update,
    ``micro_steps``, backwards so far in this micro-step). Both events vote, so a rank at
    a backward meets a peer at the update in a vote of the same shape, never in a
    reduction. Where they differ, every rank raises the same RankDivergenceError naming
    each rank's micro-step and backward, before any mismatched reduction is launched, and
    no collective is left waiting. Not voted: backwards that only accumulate on the rank
    (stages 0-1 inside the window, ``no_sync``, a block that keeps them local: the step's
    fingerprint, which notes every backward, catches an extra one there), stage 3 (as
    above) and a world of one. Each vote is read where the rank next launches a collective
    (Note "deferred verdicts" in ``comm/agreement.py``); an error of this rank's own in
    between (a refusal in ``begin_backward`` or in ``_update``, a failed
    ``engine.backward``) reads it first, and a second backward in a micro-step, which the
    stage may refuse inside its first gradient's hook, reads its vote at once. Cost per
    vote: one asynchronous all-reduce of six int64; per window, one for each reducing
    backward (``gradient_accumulation_steps`` at stage 2, one at stages 0-1) and one for
    the update (figures in docs/divergence.md), until the ranks agree on a cycle's votes:
    then a vote the plan has next is not cast (Note "vote plans" in ``vote_plan.py``).
    ``"backward_votes": false`` (zerotrain's key) turns these votes off, for a script known
    to run the same backwards on every rank; unmanaged accumulation votes regardless.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from ..comm.agreement import vote
from .vote_plan import VotePlan
from ..errors import AccumulationModeError, ContextMisuseError, RankDivergenceError
from ..stages.factory import shards_optimizer

if TYPE_CHECKING:
    from .surface import EngineSurface
else:
    EngineSurface = object   # typing only (surface.py)


class EngineAccumulation(EngineSurface):
    """``no_sync()`` and ``coalesce_grad_reduction()`` (Note: no_sync), and the window the
    caller's ``step()`` ends with ``managed_gradient_accumulation: false`` (Note: unmanaged
    accumulation)."""

    pipeline_parallelism = False   # DeepSpeed's engine flag: this engine runs no pipeline
    _vote_plan: Optional[VotePlan] = None   # stages 0-2: Note "vote plans" in vote_plan.py

    def managed_gradient_accumulation(self) -> bool:
        """DeepSpeed's accessor: False when the caller's ``step()`` ends every accumulation
        window (Note: unmanaged accumulation)."""
        return self.config.managed_gradient_accumulation

    def _refuse_unmanaged(self, call: str) -> None:
        if not self.managed_gradient_accumulation():
            raise AccumulationModeError(
                f"{call} is not supported with managed_gradient_accumulation=False: the "
                "caller already owns the accumulation boundary, every step() ends the window "
                "and reduces once (remove the call, or the key)")

    def _agree_on_window(self, event: str) -> None:
        """Every rank is at the same ``event`` ("backward", "update", "flush": the exit of
        a stage-2 ``coalesce_grad_reduction()`` block, or "held": a stage-1 block's exit,
        voting as its last backward) at the same place, or
        every rank raises RankDivergenceError naming what each was doing. Collective where
        a rank could otherwise start collectives its peers do not (Notes: unmanaged
        accumulation, backwards that reduce); nothing elsewhere."""
        if self.stage.partitions_parameters:   # stage 3 checks its own launches
            return
        update = event == "update"
        if not self.managed_gradient_accumulation():
            if not (update or self.stage.reduces_every_micro_step):
                return
            values: tuple[int, ...] = (update, self.accumulation_window.window_backwards)
            self._vote(("unmanaged", *values), values, label=f"unmanaged accumulation: {event}",
                       refuse=self._unmanaged_refusal)
            return
        held = event == "held"   # a stage-1 block's exit, as its last backward (Note)
        backward = event == "backward"
        if not self.config.backward_votes or not (not backward or self._backward_reduces()):
            return   # switched off: a rank's extra backward then aborts or hangs
        # a second backward in a micro-step is read at once: the stage may refuse it in its
        # first gradient's hook, where no launch would read the vote first (Note "deferred
        # verdicts" in comm/agreement.py); one backward per micro-step pays no wait
        backwards = self.accumulation_window.micro_backwards
        values = ((_EVENTS.index("backward"), self.micro_steps, backwards - 1)
                  if held else (_EVENTS.index(event), self.micro_steps, backwards))
        label = f"backward vote: {'backward' if held else event}"   # the step's trail too
        plan = self._vote_plan
        key = ("managed", values[0], values[1] - (plan.base if plan else 0), values[2])
        self._vote(key, values, label=label, refuse=self._backward_refusal,
                   deferred=not backward or not backwards)

    def _vote(self, key: tuple, values: tuple, *, label: str, refuse,
              deferred: bool = True) -> None:
        """Cast a position vote, unless the cycle's vote plan has this one next (Note
        "vote plans" in engine/vote_plan.py: ``key`` is ``values`` with the micro-step
        counted from the last step)."""
        plan = self._vote_plan
        if plan is not None and plan.admit(key, lambda: self._describe_vote_key(key)):
            return
        vote(self.comm, values, label=label, refuse=refuse, deferred=deferred)

    def _describe_vote_key(self, key: tuple) -> str:
        """A vote plan's key as the votes' errors read it (Note "vote plans")."""
        if key[0] == "unmanaged":
            return _unmanaged(*key[1:])
        plan = self._vote_plan
        event, micro_step, backwards = key[1:]
        return _managed(event, micro_step + (plan.base if plan else 0), backwards)

    def _agree_on_call(self, call: str) -> None:
        """Before ``save_checkpoint`` or ``load_checkpoint`` (``call``), collective: every
        rank is making this call, or every rank raises RankDivergenceError together
        (docs/divergence.md, "Collective calls"). At stages 0-2 a vote shaped as the
        training votes (a peer still training meets it at its next backward or update vote
        and raises there; where a vote plan stands, this rank leaves it first: Note "vote
        plans" in engine/vote_plan.py); at stage 3 a header (``agree_on_call``) that meets
        the peer's next unit gather or step. Read at once: nothing of the call starts
        before."""
        if self.stage.partitions_parameters:
            self.stage.agree_on_call(call)
            return
        describe: Callable[..., str]
        values: tuple[int, ...]
        if self.managed_gradient_accumulation():
            values = (_EVENTS.index(call), self.micro_steps,
                      self.accumulation_window.micro_backwards)
            describe = _managed
        else:
            values = (_UNMANAGED_CALLS.index(call), self.accumulation_window.window_backwards)
            describe = _unmanaged
        if self._vote_plan is not None:
            self._vote_plan.leave_for(f"{call}() ({describe(*values)})")
        vote(self.comm, values, label=f"{call} vote", deferred=False,
             refuse=lambda seen: self._call_refusal(call, seen, describe))

    def _call_refusal(self, call: str, seen: list[tuple[int, ...]],
                      describe) -> RankDivergenceError:
        return RankDivergenceError(
            f"rank {self.comm.rank}: not every rank is at {call}() "
            f"({_describe(seen, describe)}). {call}() is collective: every rank calls it "
            "at the same point (a call under `if rank == 0:` is the usual cause); see "
            "docs/divergence.md")

    def _unmanaged_refusal(self, seen: list[tuple[int, ...]]) -> RankDivergenceError:
        calls = [_UNMANAGED_CALLS[v[0]] for v in seen if 2 <= v[0] < len(_UNMANAGED_CALLS)]
        if calls:   # a peer at save_checkpoint/load_checkpoint: name that
            return self._call_refusal(calls[0], seen, _unmanaged)
        return RankDivergenceError(
            f"rank {self.comm.rank}: with managed_gradient_accumulation=False every rank must "
            "run the same number of backwards before each step(), and they did not "
            f"({_describe(seen, _unmanaged)})")

    def _backward_refusal(self, seen: list[tuple[int, ...]]) -> RankDivergenceError:
        calls = [_EVENTS[v[0]] for v in seen if 3 <= v[0] < len(_EVENTS)]
        if calls:   # a peer at save_checkpoint/load_checkpoint: name that
            return self._call_refusal(calls[0], seen, _managed)
        return RankDivergenceError(
            f"rank {self.comm.rank}: the ranks ran different backwards "
            f"({_describe(seen, _managed)}). Every rank must run the same backwards in "
            "each micro-step: a backward that reduces gradients over ranks (every one at "
            "ZeRO stage 2, the one ending the accumulation window at stages 0 and 1) "
            "meets the same backward on every other rank. A loss computed on some ranks "
            "only (an auxiliary loss, a retried backward) is the usual cause; see "
            "docs/divergence.md")

    @contextlib.contextmanager
    def _votes_first(self) -> Iterator[None]:
        """An error raised here, after a vote and before the launch that would read it,
        reads the vote first: where the ranks disagree, its verdict is the error every rank
        raises (the peers wait for this rank's report), not this rank's own (Note "deferred
        verdicts" in comm/agreement.py)."""
        try:
            yield
        except BaseException:
            self.comm.read_deferred()
            raise

    def _backward_reduces(self) -> bool:
        """Whether the backward about to run reduces gradients over ranks: every one at
        stage 2, the window's last at stages 0-1, none that a block keeps local (Note:
        backwards that reduce)."""
        return not self.accumulation_window.inside_no_sync and (
            self.stage.reduces_every_micro_step or self.is_gradient_accumulation_boundary())

    def _reduce_local_gradients(self, boundary: bool = True) -> None:
        """One reducing empty backward: the local sums go over the ranks once."""
        self.stage.reduce_local(boundary)
        self.accumulation_window.reduced_local()

    def _flush_coalesced_reduction_zero3(self, optimizer: Any) -> None:
        """DeepSpeed's stage-3 flush at a ``coalesce_grad_reduction()`` block's exit: the
        block's held gradients are reduce-scattered once into the partitioned gradients,
        as one backward's are (Note "held backwards" in stages/buckets.py). The block
        calls it through the instance, so a wrapper assigned on the engine sees it.
        ``optimizer`` is this engine's (DeepSpeed's signature): its ``micro_step_id`` (the
        backwards reduced into the partitions since the last update) is 0 here after a
        block that began the window, and counts this flush once it returns. Collective."""
        if optimizer is not self.optimizer:
            raise ValueError("_flush_coalesced_reduction_zero3 takes this engine's optimizer "
                             f"(engine.optimizer), got {type(optimizer).__name__}")
        if not self.stage.partitions_parameters:
            raise ContextMisuseError(
                f"_flush_coalesced_reduction_zero3 at ZeRO stage "
                f"{self.zero_optimization_stage()}: it is stage 3's flush")
        self._reduce_local_gradients(self.is_gradient_accumulation_boundary())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside keep their gradients on this rank; the accumulation window's next
        backward outside reduces them with its own (Note: no_sync). Stages 0 and 1 only."""
        if self.stage.reduces_every_micro_step:
            raise ContextMisuseError(
                f"engine.no_sync() is not supported at ZeRO stage "
                f"{self.zero_optimization_stage()}: it partitions gradients, reduce-scattering "
                "each backward's gradients into shards, so none can stay local (DeepSpeed "
                "refuses it there too); accumulate with gradient_accumulation_steps instead")
        window = self.accumulation_window
        if window.coalescing:
            raise ContextMisuseError(
                "engine.no_sync() inside coalesce_grad_reduction(): the block already keeps "
                "its backwards local and reduces them once at its exit; nesting no_sync in it "
                "is refused, as in DeepSpeed")
        outer = window.enter_no_sync()
        try:
            yield
        finally:
            window.leave_no_sync(outer)

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """DeepSpeed 0.19's one reduction per step: the backwards inside keep their
        gradients on this rank and leaving the block reduces them once, so N backwards
        issue the collectives of one; ``step()`` comes after it. Stage 1 accumulates
        locally as under ``no_sync``; stages 2 and 3 hold each backward's gradients apart
        from the shard sum, whole and unreduced, in the accumulation dtype, and the exit
        reduce-scatters them in the stage's usual buckets (Note "held backwards" in
        stages/buckets.py; at stage 3 through ``_flush_coalesced_reduction_zero3``). The
        price at stages 2 and 3: until the exit each rank holds the full gradient (4 bytes
        per trained parameter in fp32 accumulation), not its shard, as DeepSpeed's block
        keeps every ``.grad``. The mean the step applies is the plain loop's, its sums
        added in another order (equal bit for bit where they are exact)."""
        self._refuse_unmanaged("coalesce_grad_reduction")
        if not shards_optimizer(self.zero_optimization_stage()):
            raise NotImplementedError("coalesce_grad_reduction requires ZeRO stage 1/2/3, "
                                      "got stage 0")
        if self.pipeline_parallelism:
            raise NotImplementedError("coalesce_grad_reduction is not supported with "
                                      "pipeline parallelism")
        wrapper = _unpatchable_wrapper(getattr(self, "optimizer", None))
        if wrapper is not None:
            raise NotImplementedError(
                f"coalesce_grad_reduction does not support the optimizer wrapper {wrapper} "
                "that DeepSpeed uses for this config (ZeRO stage 1 with bf16 parameters, "
                "data_types.grad_accum_dtype \"fp32\" and no optimizer offload), as in "
                "DeepSpeed; remove data_types.grad_accum_dtype (zerotrain accumulates in fp32 "
                "by default, and DeepSpeed then uses its ZeRO optimizer, which takes the "
                "block), offload the optimizer, or use stage 2")
        window = self.accumulation_window
        if window.inside_no_sync or window.coalescing:
            raise ContextMisuseError("coalesce_grad_reduction cannot be nested inside another no_sync "
                             "or coalesce_grad_reduction block")
        window.enter_coalescing()
        try:
            yield
        finally:
            window.leave_coalescing()
            if window.local_backwards:   # the flush
                if self.stage.partitions_parameters:
                    self._flush_coalesced_reduction_zero3(self.optimizer)
                elif self.stage.reduces_every_micro_step:
                    # the held backwards launch here: a rank whose peers reduced each
                    # backward meets their vote with this one (Note: backwards that reduce)
                    self._agree_on_window("flush")
                    self._reduce_local_gradients(self.is_gradient_accumulation_boundary())
                else:
                    # stage 1: the exit's reduction is the one the window's last backward
                    # launches without the block, and it votes as that backward would, so
                    # peers that ran without the block agree (Note: backwards that reduce)
                    self._agree_on_window("held")
                    self._reduce_local_gradients()


def _unpatchable_wrapper(optimizer: Any) -> Optional[str]:
    """The DeepSpeed optimizer wrapper this engine's optimizer stands for when DeepSpeed's
    ``coalesce_grad_reduction`` refuses it (``BF16_Optimizer``: its own gradient path, which
    the block cannot patch), else None. zerotrain's stage 1 could run the block there; it
    refuses so that a script behaves the same on both, and loses nothing: without the
    explicit ``grad_accum_dtype`` key zerotrain accumulates in fp32 all the same."""
    kinds = getattr(optimizer, "deepspeed_kinds", ())
    return "BF16_Optimizer" if "BF16_Optimizer" in kinds else None


def _describe(seen: list[tuple[int, ...]], what) -> str:
    """Each rank's place, from its vote's values, in rank order."""
    return "; ".join(f"rank {r}: {what(*values)}" for r, values in enumerate(seen))


# an unmanaged vote's first value: 0 a backward, 1 an update, then the collective calls
_UNMANAGED_CALLS = ("backward", "update", "save_checkpoint", "load_checkpoint")


def _unmanaged(update: int, backwards: int) -> str:
    if update >= 2:
        return f"{_UNMANAGED_CALLS[update]}() after {backwards} backward(s)"
    return f"an update after {backwards} backward(s)" if update else f"backward {backwards + 1}"


# what a managed vote says a rank is about to do (its first value)
_EVENTS = ("backward", "update", "flush", "save_checkpoint", "load_checkpoint")


def _managed(event: int, micro_step: int, backwards: int) -> str:
    if _EVENTS[event] in ("save_checkpoint", "load_checkpoint"):
        return f"{_EVENTS[event]}() at micro-step {micro_step}"
    if _EVENTS[event] == "update":
        return f"the update at micro-step {micro_step}, after {backwards} backward(s) in it"
    if _EVENTS[event] == "flush":
        return (f"the exit of coalesce_grad_reduction() at micro-step {micro_step}, "
                f"reducing the {backwards} backward(s) it held")
    return f"backward {backwards + 1} of micro-step {micro_step}"
