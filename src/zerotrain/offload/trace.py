"""A timeline of the offloaded step, per record, written as a Chrome trace-event file.

Note: the step timeline
    With ``offload_optimizer.trace_path`` the host updater records, per record, when its
    gradient was handed to the host (an instant), and the spans of waiting for its copy,
    keeping its state aside, its Adam step (on the worker thread when speculative) and its
    upload, on the host's clock (``time.perf_counter``; the GPU side of a copy is the span
    the host waits for it). After every step the last step's events are written, replacing
    the file, in the trace-event JSON format that ``chrome://tracing`` and Perfetto open
    (``{"traceEvents": [...]}``, microseconds, one row per thread).
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Iterator, Optional


class Timeline:
    """Events of the current step; ``write`` saves them and starts afresh."""

    def __init__(self, path: str, rank: int = 0) -> None:
        self.path = path
        self.pid = rank
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._origin = time.perf_counter()

    def _now_us(self) -> float:
        return (time.perf_counter() - self._origin) * 1e6

    def instant(self, name: str, record: int) -> None:
        self._add({"name": name, "ph": "i", "s": "t", "ts": self._now_us(),
                   "args": {"record": record}})

    @contextlib.contextmanager
    def span(self, name: str, record: Optional[int] = None) -> Iterator[None]:
        start = self._now_us()
        try:
            yield
        finally:
            event = {"name": name, "ph": "X", "ts": start, "dur": self._now_us() - start}
            if record is not None:
                event["args"] = {"record": record}
            self._add(event)

    def _add(self, event: dict) -> None:
        event.update(pid=self.pid, tid=threading.get_ident() % 2**31,
                     cat="offload")
        with self._lock:
            self._events.append(event)

    def write(self) -> None:
        """Write this step's events to ``path`` (atomically) and start the next step."""
        with self._lock:
            events, self._events = self._events, []
        names = {e["tid"] for e in events}
        meta = [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                 "args": {"name": "host step" if tid == threading.get_ident() % 2**31
                          else "worker"}} for tid in sorted(names)]
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)


class NoTimeline:
    """No trace asked for: every call does nothing."""

    def instant(self, name: str, record: int) -> None:
        pass

    @contextlib.contextmanager
    def span(self, name: str, record: Optional[int] = None) -> Iterator[None]:
        yield

    def write(self) -> None:
        pass


def rank_path(path: str, rank: int) -> str:
    """One file per rank: ``{rank}`` in the path is filled in, else rank r > 0 appends
    ``.rank<r>``."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    return path if rank == 0 else f"{path}.rank{rank}"
