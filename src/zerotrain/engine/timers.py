"""Time spent per part of a training step (forward, backward, step), true on a GPU too.

Note: timing on a GPU
    CUDA kernels run after the host has queued them, so host time around ``forward`` only
    measures how long queueing took. On a CUDA device each timed block records a CUDA event
    at its start and end on the current stream instead; nothing waits then, and the
    elapsed device time is read when the breakdown is taken (``take``), which waits for the
    last event only. On the CPU the host clock is the truth and is used.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch

_FOLD_AT = 256   # pending event pairs before finished ones are folded into seconds


class StepTimers:
    """Adds up seconds per part; ``take`` returns them and starts afresh."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = torch.device(device).type == "cuda"
        self._seconds: dict[str, float] = defaultdict(float)
        self._pending: list[tuple[str, "torch.cuda.Event", "torch.cuda.Event"]] = []

    @contextlib.contextmanager
    def time(self, part: str) -> Iterator[None]:
        if not self.on_cuda:
            start = time.perf_counter()
            try:
                yield
            finally:
                self._seconds[part] += time.perf_counter() - start
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            yield
        finally:
            end.record()
            self._pending.append((part, begin, end))
            if len(self._pending) >= _FOLD_AT:
                self._fold(wait=False)

    def take(self) -> dict[str, float]:
        """Seconds per part since the last call (waits for the last timed GPU work)."""
        self._fold(wait=True)
        taken = dict(self._seconds)
        self._seconds.clear()
        return taken

    def _fold(self, *, wait: bool) -> None:
        still = []
        for part, begin, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                still.append((part, begin, end))
                continue
            self._seconds[part] += begin.elapsed_time(end) / 1e3   # milliseconds
        self._pending = still
