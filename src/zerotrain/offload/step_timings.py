"""Seconds the host step spends, by part, for ``wall_clock_breakdown``.

Apart from the updater because two threads add to the same figures (the step's, and the
delayed update's worker), so the counting needs its lock, and the updater only says what
it is timing.

Note: where the time goes
    ``timings`` adds up, per part, the seconds the step spends waiting for gradients to
    reach the host (``offload_gradient_wait``), for NVMe reads and writes
    (``offload_nvme_read_wait``, ``offload_nvme_write_wait``), in the CPU Adam
    (``offload_cpu_adam``), sending new values to the device (``offload_publish``) and, with
    ``dpu``, waiting for the delayed update (``offload_delayed_wait``). With
    ``wall_clock_breakdown`` the engine logs them next to forward/backward/step, so a slow
    offloaded step shows which part is slow.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict


class StepTimings:
    """Seconds by part since the last :meth:`take` (Note: where the time goes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = defaultdict(float)

    def timed(self, part: str) -> "_Timer":
        """A context manager adding its block's seconds to ``part``."""
        return _Timer(self, part)

    def add(self, part: str, seconds: float) -> None:
        with self._lock:
            self._seconds[part] += seconds

    def take(self) -> dict[str, float]:
        """The seconds by part since the last call, and start counting afresh."""
        with self._lock:
            taken, self._seconds = dict(self._seconds), defaultdict(float)
        return taken


class _Timer:
    """Adds a block's seconds to ``timings`` (under its lock: the delayed update's worker
    thread times its parts too)."""

    def __init__(self, timings: StepTimings, part: str) -> None:
        self.timings, self.part = timings, part

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.timings.add(self.part, time.perf_counter() - self.start)
