"""The peak of live tensor storages over a stretch of code, checked after every operation.

Why its own tracker: the planner (:mod:`zerotrain.planner`) runs one training step on fake
tensors and a validation run does the same step on real ones; both must be measured the
same way, and neither RSS (allocator caches, the interpreter) nor a sample now and then
(misses the transient peak inside backward) measures what decides whether a step fits. A
``TorchDispatchMode`` sees every tensor an operation returns; a weak reference on each
storage says when it is freed. What exists before (the model) is added by the caller.
Works alike for real and fake tensors (a fake storage reports the bytes it would have).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PeakTracker"]


class PeakTracker(TorchDispatchMode):
    """Live storage bytes after every operation; ``peak`` and what was alive at it.

    ``phase`` names the part of the step under way (set by the caller); each storage
    remembers the phase that created it, and ``at_peak`` maps the storages alive at the
    peak to (bytes, phase). ``where`` is the phase in which the peak happened.
    """

    def __init__(self, device_type: Optional[str] = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.phase = "before"
        self.live: dict[Any, tuple[int, str]] = {}   # id(storage) -> (bytes, phase made)
        self._refs: dict[int, Any] = {}
        self.current = 0
        self.peak = 0
        self.where = "before"
        self.at_peak: dict[int, tuple[int, str]] = {}
        self.phase_peaks: dict[str, int] = {}   # the highest live bytes within each phase

    # ---------------------------------------------------------------- storages
    def _add(self, t: torch.Tensor) -> None:
        if self.device_type is not None and t.device.type != self.device_type:
            return
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(st)
        if key in self.live:
            return
        nbytes = st.nbytes()
        if nbytes == 0:
            return
        try:
            self._refs[key] = weakref.ref(st, self._freed(key))
        except TypeError:
            return
        self.live[key] = (nbytes, self.phase)
        self.current += nbytes

    def _freed(self, key: int) -> Callable[[Any], None]:
        def gone(_ref: Any) -> None:
            entry = self.live.pop(key, None)
            self._refs.pop(key, None)
            if entry is not None:
                self.current -= entry[0]
        return gone

    def add_existing(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` (the model as built, before the step)."""
        for t in tensors:
            self._add(t)
        self._record()

    def hold(self, key: Any, nbytes: int) -> None:
        """Count ``nbytes`` that no operation returns (a backend's own buffer, made in C++
        below the dispatcher) as live until :meth:`release` of ``key``."""
        if key not in self.live:
            self.live[key] = (nbytes, self.phase)
            self.current += nbytes
            self._record()

    def release(self, key: Any) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]

    def category_of(self, tensors_by_category: dict[str, list]) -> dict[int, str]:
        """id(storage) -> category, for the storages of the given tensors alive now."""
        out: dict[int, str] = {}
        for category, tensors in tensors_by_category.items():
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    try:
                        out.setdefault(id(t.untyped_storage()), category)
                    except (RuntimeError, NotImplementedError):
                        pass
        return out

    # ---------------------------------------------------------------- the mode
    def _record(self) -> None:
        if self.current > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.current
        if self.current > self.peak:
            self.peak = self.current
            self.where = self.phase
            self.at_peak = dict(self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        self._record()
        return out
