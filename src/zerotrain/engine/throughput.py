"""Training samples per second, under DeepSpeed's name ``engine.tput_timer``.

Note: what the rate measures
    Optimizer steps are the unit: every applied or skipped step consumes one global batch
    (``train_batch_size`` samples over all ranks). The rate is those samples divided by the
    wall-clock time from the end of step ``start_step`` to the end of the latest step, so
    it includes data loading and everything else the loop does, and leaves out the first
    steps (allocation, compilation, autotuning). On a CUDA device the step ends are CUDA
    events recorded on the current stream: nothing waits while training, and reading the
    rate waits for the latest step only (Note: timing on a GPU in ``timers.py``).

    DeepSpeed's bracket fields ride along: ``start()`` (the engine's forward) opens a
    micro-step, ``stop()`` closes it and counts it; once ``start_step`` steps are done, each
    bracket's host-clock length (``end_time - start_time``, no device wait) adds to
    ``total_elapsed_time`` and to ``step_elapsed_time`` (reset at each optimizer step).
    As in DeepSpeed, ``stop()`` without an open bracket counts nothing; the engine opens
    one itself when a micro-step ends without its forward (a module called directly).
"""
from __future__ import annotations

import time
from typing import Optional, Union

import torch


_Mark = Union[float, torch.cuda.Event]   # a perf_counter time, or a recorded CUDA event


class ThroughputTimer:
    """Counts epochs, micro-steps and optimizer steps; ``avg_samples_per_sec()`` is the
    rate since warm-up (Note: what the rate measures)."""

    def __init__(self, batch_size: int, device: torch.device, start_step: int = 2) -> None:
        self.batch_size = batch_size
        self.start_step = start_step
        self.on_cuda = torch.device(device).type == "cuda"
        self.epoch_count = 0
        self.micro_step_count = 0     # micro-steps since the epoch began
        self.global_step_count = 0
        self.initialized = False      # start() was called once (DeepSpeed's fields)
        self.started = False          # a bracket is open
        self.start_time = 0.0         # the open bracket's start (0 before start_step)
        self.end_time = 0.0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._first: Optional[_Mark] = None   # step ``start_step``'s end: a time or event
        self._last: Optional[_Mark] = None

    def update_epoch_count(self) -> None:
        """A new epoch begins (scripts call this at the end of each epoch)."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """A micro-step begins (the engine's forward): open its bracket."""
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False) -> None:
        """The open micro-step ended; ``global_step``: it ended with an optimizer step.
        Without an open bracket (no ``start()`` since the last ``stop()``) nothing counts."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = time.time()
            self.total_elapsed_time += self.end_time - self.start_time
            self.step_elapsed_time += self.end_time - self.start_time
            if global_step:
                self.step_elapsed_time = 0.0
        if not global_step:
            return
        if self.global_step_count < self.start_step:
            return
        mark = self._mark()
        if self.global_step_count == self.start_step:
            self._first = mark
        self._last = mark

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the steps after ``start_step``; ``-inf`` before any."""
        steps = self.global_step_count - self.start_step
        if steps <= 0:
            return float("-inf")
        return steps * self.batch_size / max(self._seconds(), 1e-9)

    def _mark(self) -> _Mark:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self) -> float:
        first, last = self._first, self._last
        if isinstance(first, float) and isinstance(last, float):   # perf_counter marks
            return last - first
        assert isinstance(first, torch.cuda.Event) and isinstance(last, torch.cuda.Event)
        last.synchronize()
        return first.elapsed_time(last) / 1e3   # milliseconds
