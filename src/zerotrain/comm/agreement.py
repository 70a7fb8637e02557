"""Ranks agree on where they are, before collectives that only one rank may be about to start.

Why a module of its own: a step's fingerprint (``trail.py``) is compared at the step, but at
ZeRO stage 2 every backward launches reduce-scatters, so a rank that runs one more backward
than its peers would pair those with the peers' next collectives long before the step
(gloo aborts the process; NCCL hangs or sums mismatched buffers). The engine therefore
asks, before such a backward and before the update, whether every rank is at the same
place; the collective that answers is here, with the comm layer's others.

Note: position votes
    Each rank passes a few small integers saying where it is (the engine's: what it is
    about to do, its micro-step, its backwards in that micro-step). One all-reduce of each
    value ``v`` and its square, taken modulo ``MODULUS``, sums them over ranks;
    ``world * sum(v^2) == sum(v)^2`` exactly when every rank's ``v`` is the same (equality
    in Cauchy-Schwarz), and every rank sees the same sums, so all reach the same verdict at
    once. The values are exact (int64: ``world^2 * MODULUS^2`` stays below 2^63 up to
    about 700,000 ranks) and counters that disagree differ by a backward or a step at the
    first vote after they part, never by a multiple of ``MODULUS``. Only when they
    disagree do the ranks exchange their true values (one ``all_gather_object``), so that
    every rank raises naming what each rank was doing; no collective is left waiting and
    the process group stays usable. Cost per vote: ``2 * len(values)`` int64 elements on
    the wire (counted apart in the ledger, as ``divergence_check``) and the wait for its
    verdict (Note: deferred verdicts).

Note: deferred verdicts
    A vote is launched asynchronously and its verdict read only just before this rank's
    next launch through a communicator sharing its pending list (``Communicator.defer``:
    the engine's, its subgroups'): the first gradient reduction of the backward, the
    step's norm all-reduce, the next vote. What a rank does in between (the backward's
    first gradients, the step's local norms) runs beside the vote: on gloo the all-reduce
    runs on gloo's thread; on a device the wire goes up by a non-blocking copy from pinned
    memory and the sums come back on a side stream, so the host waits for the vote alone,
    never for the compute queue. Every rank sees the same sums, so where they differ every
    rank raises at its next launch, having launched nothing after the vote, and the report
    (``all_gather_object``, run while the list is empty, so reading does not recurse)
    pairs up on every rank. The error, or the vote's own failure (a rank that never came),
    is marked (``from_a_vote``) so that the engine does not complete a backward it
    interrupted (Note "a failed backward" in ``trail.py``: that would launch the very
    reductions the vote kept back). A rank that raises an error of its own between a vote
    and its next launch reads the vote first (the engine does: Note "backwards that reduce"
    in ``engine/accumulation.py``), so the peers' report is answered. A vote still unread
    when nothing more is launched (the end of training) only holds its small tensors; gloo
    finishes it on its own, and nothing at close or exit reads it.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .communicator import Communicator

MODULUS = 4096
VERDICT = "zerotrain_vote_verdict"   # set on the error a vote's verdict raised

Refusal = Callable[[list[tuple[int, ...]]], BaseException]


def vote(comm: Communicator, values: Sequence[int], *, label: str, refuse: Refusal,
         deferred: bool = True) -> None:
    """Every rank of ``comm`` passes ``values``; where they differ, every rank raises
    ``refuse(seen)`` (``seen``: every rank's values in rank order, the same list on every
    rank). With ``deferred`` the verdict is read just before this rank's next launch
    (Note: deferred verdicts), else at once. Collective; a world of one, or a traced world
    that carries no data, agrees at once."""
    if comm.world_size == 1 or not comm.carries_data:
        return
    pending = _Pending(comm, values, label, refuse)
    if deferred:
        comm.defer(pending.read)
    else:
        pending.read()


def from_a_vote(exc: BaseException) -> bool:
    """Whether ``exc`` came from reading a vote: its verdict (every rank of the group raised
    it together and launched nothing after the vote), or the vote's own failure (a rank
    never came: the group is broken). Either way nothing more is to be launched."""
    return getattr(exc, VERDICT, False)


class _Pending:
    """A vote launched and not yet read (Note: deferred verdicts)."""

    __slots__ = ("comm", "values", "label", "refuse", "work", "wire", "host", "done")

    def __init__(self, comm: Communicator, values: Sequence[int], label: str,
                 refuse: Refusal) -> None:
        self.comm, self.values, self.label, self.refuse = comm, tuple(values), label, refuse
        small = [int(v) % MODULUS for v in values]
        wire = torch.tensor(small + [v * v for v in small], dtype=torch.int64)
        if comm.device.type != "cpu":   # a synchronous copy would wait for the queue
            wire = wire.pin_memory().to(comm.device, non_blocking=True)
        self.wire = wire
        self.work = comm.all_reduce(wire, label=label, carried=wire.numel(), async_op=True)
        self.host: Optional[torch.Tensor] = None
        self.done = None
        if wire.device.type == "cuda":   # the sums come back on a stream of their own
            self.host, self.done = _copy_back(self.work, wire)

    def read(self) -> None:
        """Wait for the sums; raise the refusal, the same on every rank, where they differ.
        Either error, or the vote's own failure (a rank that never came), is marked."""
        try:
            self._read()
        except Exception as exc:
            setattr(exc, VERDICT, True)
            self.comm.stopped_by_vote = exc   # read by whoever must not launch after it
            raise

    def _read(self) -> None:
        if self.done is not None:
            assert self.host is not None   # set together with done, in __init__
            self.done.synchronize()   # the vote and its copy only, not the compute queue
            sums = self.host.tolist()
        else:
            self.work.wait()
            sums = self.wire.tolist()
        self.comm.ledger.host_reads["vote"] += 1
        n, world = len(self.values), self.comm.world_size
        if all(world * q == s * s for s, q in zip(sums[:n], sums[n:])):
            return
        seen = self.comm.all_gather_object(tuple(int(v) for v in self.values),
                                           label=f"{self.label}: report")
        raise self.refuse([tuple(v) for v in seen])


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _copy_back(work, wire: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """On a device: queue, on a side stream, the wait for the vote and the copy of its sums
    to pinned host memory, and an event after them; the compute stream never waits."""
    side = _SIDE.get(wire.device)
    if side is None:
        side = _SIDE[wire.device] = torch.cuda.Stream(device=wire.device)
    host = torch.empty(wire.shape, dtype=wire.dtype, pin_memory=True)
    with torch.cuda.stream(side):
        work.wait()   # NCCL: the side stream waits, the host does not
        host.copy_(wire, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    return host, done
