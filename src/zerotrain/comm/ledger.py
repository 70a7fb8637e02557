"""The communication ledger: what each collective puts on the wire, counted.

Why a module of its own: the ledger is plain bookkeeping (no process group, no torch
collective), read by tests and by ``engine.communication_breakdown`` to check the ZeRO
volumes instead of trusting the design; the communicators only write into it.

Note: intra-node and cross-node bytes
    Each communicator knows the nodes of its members (``topology.py``). A collective over a
    group whose members all share a node is counted as ``intra_node`` bytes; one over a
    group spanning nodes as ``cross_node`` bytes, whole: in a ring over several nodes every
    element passes the links between nodes, so the counted volume is what the slow network
    carries. Hierarchical schemes (hpZ, MiCS, quantized gradients) win by running part of
    their traffic on node groups and shrinking what the cross-node groups carry.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .trail import CollectiveTrail

REACHES = ("intra_node", "cross_node")
CHECK = "divergence_check"   # bytes of the checks carried inside other collectives


@dataclass
class CommLedger:
    """Counts collectives and the elements/bytes they move, per operation name; bytes are
    also split by reach (Note: intra-node and cross-node bytes)."""

    calls: Counter = field(default_factory=Counter)
    elements: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)
    by_reach: dict = field(default_factory=lambda: {r: Counter() for r in REACHES})
    # the step's collectives in order (``trail.py``); ``reset`` leaves it alone
    trail: CollectiveTrail = field(default_factory=CollectiveTrail)
    # results of collectives read on the host (a device-to-host copy and a wait on a
    # device), per purpose: the proxies of a step's host round trips; ``reset`` clears it
    host_reads: Counter = field(default_factory=Counter)
    # told of each collective launched (communicator, operation, tensor, detail) where the
    # engine keeps a vote plan (Note "vote plans" in engine/vote_plan.py), else None
    launches: Optional[Callable] = None

    def record(self, op: str, tensor: torch.Tensor, factor: int = 1,
               reach: str = "intra_node", carried: int = 0) -> None:
        """One collective over ``tensor``; ``carried`` of its elements are a divergence
        check's (a gather's header, a step's fingerprint), counted under ``CHECK`` so that
        ``op``'s volume stays the payload's."""
        numel = tensor.numel() - carried
        nbytes = factor * numel * tensor.element_size()
        self.calls[op] += 1
        self.elements[op] += factor * numel
        self.nbytes[op] += nbytes
        self.by_reach[reach][op] += nbytes
        if carried:   # not in by_reach: the volume by reach stays the ZeRO formulas'
            self.elements[CHECK] += factor * carried
            self.nbytes[CHECK] += factor * carried * tensor.element_size()

    def record_many(self, op: str, tensors: Sequence[torch.Tensor], *, calls: int,
                    reach: str = "intra_node") -> None:
        """``tensors`` moved by ``calls`` launches (coalesced collectives): elements and
        bytes as if each were recorded, the launches counted as calls."""
        if not tensors:
            return
        numel = sum(t.numel() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.calls[op] += calls
        self.elements[op] += numel
        self.nbytes[op] += nbytes
        self.by_reach[reach][op] += nbytes

    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    def reset(self) -> None:
        self.calls.clear()
        self.elements.clear()
        self.nbytes.clear()
        self.host_reads.clear()
        for counter in self.by_reach.values():
            counter.clear()

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "elements": dict(self.elements),
                "bytes": dict(self.nbytes),
                **{f"{r}_bytes": dict(self.by_reach[r]) for r in REACHES}}
