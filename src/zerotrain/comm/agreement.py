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
    the wire (counted apart in the ledger, as ``divergence_check``) and, since the verdict
    is read on the host, one wait for the device's queue to reach the vote.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .communicator import Communicator

MODULUS = 4096


def disagreement(comm: Communicator, values: Sequence[int], *,
                 label: str) -> Optional[list[tuple[int, ...]]]:
    """None when every rank of ``comm`` passed the same ``values``; otherwise every rank's
    ``values`` in rank order, the same list on every rank (Note: position votes).
    Collective; a world of one, or a traced world that carries no data, agrees at once."""
    if comm.world_size == 1 or not comm.carries_data:
        return None
    small = [v % MODULUS for v in values]
    wire = torch.tensor(small + [v * v for v in small], dtype=torch.int64, device=comm.device)
    comm.all_reduce(wire, label=label, carried=wire.numel())
    sums = wire.tolist()
    n = len(small)
    if all(comm.world_size * q == s * s for s, q in zip(sums[:n], sums[n:])):
        return None
    seen = comm.all_gather_object(tuple(int(v) for v in values), label=f"{label}: report")
    return [tuple(v) for v in seen]
