"""The collective trail: what this rank did since the last optimizer step, as a fingerprint.

Note: step fingerprint
    Every collective a :class:`~zerotrain.comm.Communicator` launches, every training
    forward of the engine, and every use of a stage-3 unit, is noted here as (operation,
    elements, purpose), and a CRC-32 of the entries is taken at the step. There the scalar
    all-reduce that already happens (the gradient norm) carries the fingerprint too: its
    eight 4-bit digits ``d`` and their squares, summed over ranks. Every rank then knows
    whether all fingerprints agree, without another collective:
    ``world * sum(d^2) == sum(d)^2`` for every digit exactly when every rank's digit is the
    same (equality in Cauchy-Schwarz), and the sums are small integers, exact in float32 up
    to a million ranks. A rank that skipped or added a
    collective anywhere in the step (an extra forward, an exception caught in the middle of
    backward, a module skipped) is caught at that step on every rank; only then do the
    ranks exchange their trails (one ``all_gather_object``) so that the error shows the
    first entry where they differ. Cost per collective: one tuple (its CRC-32 is taken at
    the step); per step: 16 float32 elements (64 bytes) in the all-reduce. Stage 0, which
    has no scalar all-reduce, runs one of 16 elements (counted apart: ``divergence_check``).
    At stages 0-2 the entries end with the CRC-32 of the cycle's votes and collectives (Note
    "vote plans" in ``engine/vote_plan.py``), at stage 3 with the launch plan's.

Note: a failed backward
    A rank whose backward raises has launched only part of the step's gradient reductions,
    while its peers wait in the next one. If the script catches the error and carries on,
    every rank would hang there. So the engine ends such a backward as a complete one
    (the stage launches the remaining reductions, the missing gradients as zeros) before
    re-raising, and notes the failure in the trail: the peers' reductions pair up, and the
    step's fingerprint check then stops every rank at that step, naming the failure.

Note: a forward that raises
    A training forward is noted as it starts, at its place among the step's collectives. If
    it raises (an out-of-memory error the script catches, retrying on a smaller batch) and
    launched nothing, no peer saw anything of it: the entry is withdrawn, and the retry
    counts as the step's one forward. A forward that raised after launching collectives
    (stage 3's gathers, tensor parallelism's all-reduces) keeps its entry: its peers met
    those collectives, and the ranks' paths did part.
"""
from __future__ import annotations

import zlib
from typing import Optional, Sequence

DIGITS = 8            # 4-bit digits of the 32-bit fingerprint
CARRIED = 2 * DIGITS  # elements the step's all-reduce carries: the digits and their squares
MAX_ENTRIES = 4096    # entries kept for the error message (the fingerprint covers them all)


class CollectiveTrail:
    """This rank's collectives since the last step (Note: step fingerprint)."""

    __slots__ = ("crc", "count", "entries", "_crc_before")

    def __init__(self) -> None:
        self.crc = 0
        self.count = 0
        self.entries: list[tuple[str, Optional[int], str]] = []
        self._crc_before: Optional[int] = None   # the CRC before the last folded entry

    def note(self, op: str, numel: Optional[int], label: str) -> None:
        """One entry; folded into the CRC at the step (``carried``), or at once beyond the
        kept entries: the training path pays a tuple and an append."""
        self.count += 1
        if len(self.entries) < MAX_ENTRIES:
            self.entries.append((op, numel, label))
            return
        if self.count == MAX_ENTRIES + 1:   # the kept entries first, in order
            self.crc = _fold(self.entries, 0)
        self._crc_before = self.crc
        self.crc = _fold([(op, numel, label)], self.crc)

    def withdraw(self, count: int) -> bool:
        """Take back the entry noted as the ``count``-th of the step if it is still the last
        one (Note: a forward that raises); whether it was."""
        if count < 1 or self.count != count:
            return False
        if count <= MAX_ENTRIES:
            self.entries.pop()
        elif self._crc_before is None:
            return False
        else:
            self.crc, self._crc_before = self._crc_before, None
        self.count -= 1
        return True

    def restart(self) -> None:
        self.crc, self.count, self._crc_before = 0, 0, None
        self.entries.clear()

    def carried(self) -> list[float]:
        """The digits of the fingerprint (count folded in) and their squares."""
        crc = self.crc if self.count > MAX_ENTRIES else _fold(self.entries, 0)
        value = zlib.crc32(self.count.to_bytes(8, "little"), crc)
        digits = [(value >> (4 * k)) & 15 for k in range(DIGITS)]
        return [float(d) for d in digits] + [float(d * d) for d in digits]

    @staticmethod
    def agreed(sums: Sequence[float], world: int) -> bool:
        """Whether the summed ``carried()`` of ``world`` ranks came from equal fingerprints."""
        digits = [round(x) for x in sums[:DIGITS]]
        squares = [round(x) for x in sums[DIGITS:CARRIED]]
        return all(world * q == d * d for d, q in zip(digits, squares))


def _fold(entries: Sequence[tuple], crc: int) -> int:
    """CRC-32 of ``entries`` (operation, elements, purpose), continuing ``crc``."""
    return zlib.crc32("".join(f"{op}|{numel}|{label};" for op, numel, label in entries)
                      .encode(), crc)


def first_difference(trails: Sequence[Sequence[tuple]]) -> str:
    """Where the ranks' trails first differ, for an error message."""
    longest = max(len(t) for t in trails)
    for i in range(longest):
        seen = [t[i] if i < len(t) else None for t in trails]
        if any(s != seen[0] for s in seen):
            parts = "; ".join(f"rank {r}: {_describe(s)}" for r, s in enumerate(seen))
            return f"entry {i} of the step: {parts}"
    return ("the kept entries agree; the ranks differ after the first "
            f"{min(len(t) for t in trails)} entries")


def _describe(entry: Optional[tuple]) -> str:
    if entry is None:
        return "nothing (its step ended here)"
    op, numel, label = entry
    if op == "use":   # a stage-3 unit used in forward or backward (zero3/hooks.py)
        return f"use of {label}"
    if op == "left the plan":   # Note "launch plans" in stages/zero3/plan.py
        return f"left the cycle's plan: {label}"
    if op == "plan":
        return f"the optimizer step (its plan of {numel} launches, CRC-32 {label})"
    if op == "votes":   # Note "vote plans" in engine/vote_plan.py
        return f"the optimizer step (its record of {numel} votes and collectives, CRC-32 {label})"
    size = "" if numel is None else f" of {numel} elements"
    return f"{op}{size}" + (f" for {label}" if label else "")
