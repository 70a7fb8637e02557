"""Memory by category, measured by counting distinct live tensor storages.

Two tensors that view one storage count once, so flat buffers and the parameter views into
them are never double counted. Sizes are bytes of the storage, not of the view.
"""
from __future__ import annotations

import gc
import logging
import os
import resource
from typing import Iterable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

logger = logging.getLogger(__name__)


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr())


def _holds_memory(t: torch.Tensor) -> bool:
    """False for tensors without real storage: meta tensors, and the fake or functional
    tensors torch.compile leaves reachable from its caches (they have no data pointer)."""
    if t.device.type == "meta" or is_fake(t):
        return False
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    return True


class StorageLedger:
    """Adds up storages by category; a storage counts once, in the first category seen."""

    def __init__(self) -> None:
        self._seen: set = set()
        self.bytes: dict[str, int] = {}

    def add(self, category: str, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        total = self.bytes.setdefault(category, 0)
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor) or not _holds_memory(t):
                continue
            key = _storage_key(t)
            if key in self._seen or t.untyped_storage().nbytes() == 0:
                continue
            self._seen.add(key)
            total += t.untyped_storage().nbytes()
        self.bytes[category] = total


def live_storages(device: Optional[torch.device] = None) -> dict[tuple, int]:
    """Every distinct storage reachable from Python tensors (via the gc): key -> bytes."""
    found: dict[tuple, int] = {}
    for obj in gc.get_objects():
        # type() rather than isinstance(): no __class__ lookup on proxies and lazy modules
        if issubclass(type(obj), torch.Tensor) and (device is None or obj.device == device):
            if _holds_memory(obj):
                found.setdefault(_storage_key(obj), obj.untyped_storage().nbytes())
    return found


def live_tensor_bytes(device: Optional[torch.device] = None) -> int:
    """Bytes of every distinct storage reachable from Python tensors (via the gc)."""
    return sum(live_storages(device).values())


def host_rss_bytes() -> int:
    """Peak resident set size of this process (getrusage, bytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """Resident set size now (``/proc/self/statm``; the peak where that is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return host_rss_bytes()


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log this process's memory (as ``deepspeed.runtime.utils.see_memory_usage``).

    Does nothing unless ``force`` is true, like DeepSpeed. Reports live tensor bytes, peak
    host RSS and, with CUDA, the allocator's current and peak bytes. Logged at INFO.
    """
    if not force:
        return
    gc.collect()
    parts = [message, f"live tensors {live_tensor_bytes() / 2**30:.3f} GiB",
             f"peak RSS {host_rss_bytes() / 2**30:.3f} GiB"]
    if torch.cuda.is_available():
        parts.append(f"CUDA allocated {torch.cuda.memory_allocated() / 2**30:.3f} GiB "
                     f"(peak {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB)")
    logger.info(" | ".join(parts))
