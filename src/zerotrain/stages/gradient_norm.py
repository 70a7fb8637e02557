"""The step's gradient norm, taken the same way by every stage before its update.

One scalar all-reduce gives the global L2 norm of the averaged, unscaled gradient and
carries the step's collective fingerprint beside it (Note "step fingerprint" in
``comm/trail.py``); an inf/nan norm becomes the failed ``StepOutcome`` naming the
parameters affected; otherwise the result is the factor that unscales and clips. Apart
from ``base.py`` because it is arithmetic and one collective over records, with no stage
state: ``prepare_gradients`` is its whole interface.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from ..comm import Communicator
from ..comm.trail import first_difference
from ..errors import RankDivergenceError
from ..offload import Gradients
from ..core.records import ShardRecord
from .protocol import NormSpan, StepOutcome  # noqa: F401 (NormSpan: its old home)


@dataclass(frozen=True, slots=True)
class PreparedGradients:
    gradients: Gradients   # per record: the reduced shard and how to finish it
    norm: float


def prepare_gradients(records: Sequence[ShardRecord], summed: Sequence[torch.Tensor], *,
                      comm: Communicator, sharded: bool, grad_scale: float, clip: float,
                      wire: Sequence[torch.dtype] = (),
                      squares: Optional[Mapping[int, torch.Tensor]] = None,
                      average_over: Optional[int] = None,
                      norm: Optional[NormSpan] = None
                      ) -> "PreparedGradients | StepOutcome":
    """What every stage does before the update (Note "one step" in ``stages/zero12.py``).

    ``summed[i]`` is record i's gradient shard summed over ranks, left as it is: the update
    averages, unscales and clips it (Note "one arithmetic" in ``offload/gradients.py``).
    Here the global L2 norm of the averaged, unscaled gradient is taken (one scalar
    all-reduce when ``sharded``), from ``squares[i]`` where a record's squared norm was
    already taken as its buckets completed. On inf/nan the result is the failed
    StepOutcome naming the first parameter affected. With ``norm`` (tensor parallelism)
    the squares are ``norm.square``'s, summed over ``norm.comm`` rather than ``comm``.
    """
    world = average_over or comm.world_size   # MiCS: the shard group is not the world
    squares = squares or {}
    sq = torch.zeros(1, dtype=torch.float32, device=summed[0].device if summed else None)
    for i, shard in enumerate(summed):
        part = squares.get(i)
        if part is None:
            part = (norm.square(i, records[i].layout, shard) if norm is not None else
                    torch.linalg.vector_norm(shard, dtype=torch.float32).square())
        sq += part
    if norm is not None and norm.comm.world_size > 1:   # summed over both dimensions
        sq = _reduce_with_fingerprint(sq, norm.comm, True)
    elif comm.world_size > 1:   # stage 0 too: the norm's all-reduce carries the fingerprint
        sq = _reduce_with_fingerprint(sq, comm, sharded)
    total = float(sq.sqrt().item()) / world / grad_scale
    if not math.isfinite(total):   # inf for nan too, as DeepSpeed reports an overflow
        return StepOutcome(False, math.inf, _nonfinite_names(records, summed, comm, sharded))
    coef = 1.0 / grad_scale
    if clip > 0:
        coef *= min(1.0, clip / (total + 1e-6))
    wire = list(wire) or [shard.dtype for shard in summed]
    return PreparedGradients(Gradients(list(summed), wire, world, coef, 1.0 / grad_scale),
                             total)


def _reduce_with_fingerprint(sq: torch.Tensor, comm: Communicator,
                             sharded: bool, *, cycle: bool = True) -> torch.Tensor:
    """All-reduce the squared norm (only its own when not ``sharded``: stage 0 sums full
    gradients already) with the step's collective fingerprint beside it; raise
    RankDivergenceError on every rank when the ranks' fingerprints differ (Note "step
    fingerprint" in ``comm/trail.py``). With ``cycle`` (not a rank's stand-in for it) the
    step ends the cycle of ``comm``'s vote plan, if any (Note "vote plans" in
    ``engine/vote_plan.py``). Returns the squared norm."""
    trail = comm.ledger.trail
    plan = comm.vote_plan if cycle else None
    record = plan.end_cycle() if plan is not None else None
    carried = torch.tensor(trail.carried(), dtype=sq.dtype, device=sq.device)
    wire = torch.cat([sq, carried]) if sharded else carried
    comm.all_reduce(wire, label="gradient norm" if sharded else "step fingerprint",
                    carried=len(carried))
    sums = wire[-len(carried):].tolist()
    comm.ledger.host_reads["step fingerprint"] += 1
    if comm.carries_data and not trail.agreed(sums, comm.world_size):
        if plan is not None:
            plan.forget()
        trails = comm.all_gather_object(list(trail.entries), label="divergence report")
        trail.restart()
        first = first_difference(trails)   # and where a rank left a plan, if not there
        left = "".join(f"; rank {r} left the cycle's plan: {label}" for r, t in
                       enumerate(trails) for op, _, label in t
                       if op == "left the plan" and label not in first)
        raise RankDivergenceError(
            f"rank {comm.rank}: the ranks made different collectives in this step "
            f"({first}{left}). A rank took another path: a forward on some "
            "ranks only, an exception caught in the middle of backward, a module or "
            "engine call skipped on one rank. Every rank must run the same forwards, "
            "backwards and steps; see docs/divergence.md")
    if plan is not None:
        plan.adopt(record)
    trail.restart()
    return wire[:1] if sharded else sq


def _nonfinite_names(records: Sequence[ShardRecord], grads: Sequence[torch.Tensor],
                     comm: Communicator, sharded: bool, limit: int = 64) -> tuple[str, ...]:
    """Names of parameters whose gradient chunk is not finite, from every rank (at most
    ``limit`` per rank); only called on the failure path."""
    local: list[str] = []
    for record, grad in zip(records, grads):
        if bool(torch.isfinite(grad).all()):
            continue
        for j, slot in enumerate(record.layout.slots):
            if not bool(torch.isfinite(grad[record.layout.shard_slice(slot)]).all()):
                local.append(record.names[j])
        if len(local) >= limit:
            break
    everyone = comm.all_gather_object(local[:limit]) if sharded else [local[:limit]]
    return tuple(dict.fromkeys(name for names in everyone for name in names))
