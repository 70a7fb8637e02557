"""Offloaded state in files under ``nvme_path``: ``NvmeStorage``, swapped through pinned
slots for the optimizer step.

Apart from host memory (``host_storage.py``) because the files are a job of their own:
reserving space up front, mapping and unlinking each file, and the worker threads that
read a record into a slot and write it back.

Note: NVMe swapping
    Every NVMe-backed tensor is a memory map of its own file (``torch.from_file``), unlinked
    as soon as it is mapped: the space is reserved up front (``posix_fallocate``, so a full
    disk fails at initialize, not mid-step) and the files disappear when the process exits,
    however it exits. At rest a tensor reads and writes through the map, so checkpoints,
    ``GatheredParameters`` and parameter refreshes need no special path. For the optimizer
    step, a record's tensors (fp32 master, ``exp_avg``, ``exp_avg_sq``) are read with
    ``preadv`` by a worker thread into a pinned slot, re-pointed there (``Tensor.set_``, so
    the optimizer's keys stay the same objects), stepped, pointed home again and written
    back by a worker while the next record steps. ``buffer_count`` slots, 2 or 3 (one
    reading, one stepping, one writing).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import queue
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..errors import ConfigError
from ..core.log import ALL_RANKS
from .host_storage import HostStorage
from .transfers import Transfers

OPTIMIZER_SECTION = "zero_optimization.offload_optimizer"
logger = logging.getLogger(__name__)
_IO_CHUNK = 1 << 30  # bytes per preadv/pwrite call (Linux caps one call near 2 GiB)


@dataclass(slots=True)
class _Home:
    """Where a tensor lives at rest: a span of one mapped file."""

    tensor: torch.Tensor
    storage: torch.UntypedStorage
    offset: int       # elements into ``storage``
    numel: int
    fd: int
    byte_offset: int  # bytes into the file


class NvmeStorage(HostStorage):
    """State in files under ``directory``, swapped through pinned slots (Note above)."""

    category_prefix = "nvme_"
    swaps = True

    def __init__(self, directory: Optional[str], rank: int, *, slots: int = 3,
                 pin_memory: bool = True, section: str = OPTIMIZER_SECTION,
                 label: str = "swap", transfers: Optional[Transfers] = None) -> None:
        super().__init__(pin_memory, transfers)
        self.key = f"{section}.nvme_path"
        self.directory = _check_directory(directory, section)
        self.path = tempfile.mkdtemp(prefix=f"zerotrain-{label}-rank{rank}-",
                                     dir=self.directory)
        logger.info("%s: rank %d swaps to files in %s", self.key, rank, self.path,
                    extra={ALL_RANKS: True})
        # the files are unlinked as soon as they are mapped; the directory goes at close(),
        # or when this object is collected, or at interpreter exit, whichever comes first
        self._remove_directory = weakref.finalize(self, shutil.rmtree, self.path, True)
        self._fds: dict[int, int] = {}            # storage address -> file descriptor
        self._count = 0
        self._slots_wanted = max(2, slots)
        self._slots: Optional[queue.Queue] = None
        self._slot_numel = 0
        self._io_pool: Optional[ThreadPoolExecutor] = None   # started by the first swap
        self._reads: dict[int, tuple[Future, torch.Tensor, list[_Home]]] = {}
        self._resident: dict[int, tuple[torch.Tensor, list[_Home]]] = {}
        self._writes: list[Future] = []
        self.reserved_bytes = 0

    # ------------------------------------------------------------------ allocation
    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if numel == 0:
            return torch.zeros(0, dtype=dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        name = os.path.join(self.path, f"state{self._count}.bin")
        self._count += 1
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(name)
            free = shutil.disk_usage(self.directory).free
            raise ConfigError(self.key, f"cannot reserve {nbytes / 2**30:.2f} GiB more in "
                              f"{self.directory!r} ({exc.strerror}; {free / 2**30:.2f} GiB "
                              f"free, {self.reserved_bytes / 2**30:.2f} GiB reserved so far)"
                              ) from exc
        tensor = torch.from_file(name, shared=True, size=numel, dtype=dtype)
        os.unlink(name)  # the map and the descriptor keep it; the kernel frees it at exit
        self._fds[tensor.untyped_storage().data_ptr()] = fd
        self.reserved_bytes += nbytes
        return tensor

    def home_of(self, tensor: torch.Tensor) -> _Home:
        storage = tensor.untyped_storage()
        fd = self._fds.get(storage.data_ptr())
        if fd is None:
            raise ValueError("tensor was not allocated by this NvmeStorage")
        return _Home(tensor, storage, tensor.storage_offset(), tensor.numel(), fd,
                     tensor.storage_offset() * tensor.element_size())

    def reserve_slots(self, numel: int) -> None:
        """Size the pinned slots for the largest record (``numel`` fp32 elements in all)."""
        self._slot_numel = max(self._slot_numel, numel)

    # ------------------------------------------------------------------ swapping
    def prefetch(self, key: int, tensors: Sequence[torch.Tensor]) -> None:
        """Start reading ``tensors`` (all at rest, fp32) into a free slot."""
        if key in self._reads or key in self._resident:
            return
        homes = [self.home_of(t) for t in tensors]
        slot = self._take_slot(sum(h.numel for h in homes))
        self._reads[key] = (self._io().submit(self._read, slot, homes), slot, homes)

    def swap_in(self, key: int) -> None:
        """Wait for ``key``'s read and point its tensors at the slot."""
        future, slot, homes = self._reads.pop(key)
        future.result()
        at = 0
        for home in homes:
            home.tensor.set_(slot[at: at + home.numel])
            at += home.numel
        self._resident[key] = (slot, homes)

    def swap_out(self, key: int) -> None:
        """Point ``key``'s tensors home and write the slot back (asynchronously)."""
        slot, homes = self._resident.pop(key)
        for home in homes:
            home.tensor.set_(home.storage, home.offset, (home.numel,))
        self._writes.append(self._io().submit(self._write, slot, homes))

    def drain(self) -> None:
        """Wait for every write: at rest, the maps now hold the newest values."""
        writes, self._writes = self._writes, []
        for future in writes:
            future.result()

    def abort(self) -> None:
        """After a step failed part-way: point every tensor home, finish the I/O in flight
        and return its slots, so the storage is usable (and closable) again. Records read
        but not yet written back keep their values from before the step."""
        for slot, homes in self._resident.values():
            for home in homes:
                home.tensor.set_(home.storage, home.offset, (home.numel,))
            self._slots.put(slot)
        self._resident.clear()
        for future, slot, _ in self._reads.values():
            try:
                future.result()
            except Exception:   # the step is failing already; its error is what matters
                pass
            self._slots.put(slot)
        self._reads.clear()
        for future in self._writes:
            try:
                future.result()
            except Exception:
                pass
        self._writes.clear()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._io_pool is not None:
                self._io_pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._remove_directory()

    # ------------------------------------------------------------------ helpers
    def _io(self) -> ThreadPoolExecutor:
        """Worker threads for reads and writes (parameter shards, mapped only, need none)."""
        if self._io_pool is None:
            self._io_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerotrain-nvme")
        return self._io_pool

    def _take_slot(self, numel: int) -> torch.Tensor:
        if numel > self._slot_numel:
            raise ValueError(f"record of {numel} elements exceeds the reserved slot size "
                             f"{self._slot_numel}")
        if self._slots is None:
            self._slots = queue.Queue()
            for _ in range(self._slots_wanted):
                self._slots.put(torch.empty(self._slot_numel, dtype=torch.float32,
                                            pin_memory=self.pin))
        for future in [f for f in self._writes if f.done()]:
            future.result()  # surface a failed write here rather than lose it
            self._writes.remove(future)
        return self._slots.get()  # a write in flight returns its slot when it completes

    def _read(self, slot: torch.Tensor, homes: list[_Home]) -> None:
        at = 0
        for home in homes:
            _transfer(os.preadv, home.fd, slot[at: at + home.numel], home.byte_offset)
            at += home.numel

    def _write(self, slot: torch.Tensor, homes: list[_Home]) -> None:
        try:
            at = 0
            for home in homes:
                _transfer(os.pwritev, home.fd, slot[at: at + home.numel], home.byte_offset)
                at += home.numel
        finally:
            self._slots.put(slot)


def _transfer(call, fd: int, tensor: torch.Tensor, offset: int) -> None:
    """Move ``tensor``'s bytes from (``os.preadv``) or to (``os.pwritev``) the file at
    ``offset``, in chunks, retrying short transfers; releases the GIL while it waits."""
    nbytes = tensor.numel() * tensor.element_size()
    base = tensor.data_ptr()
    done = 0
    while done < nbytes:
        size = min(_IO_CHUNK, nbytes - done)
        view = (ctypes.c_char * size).from_address(base + done)
        moved = call(fd, [view], offset + done)
        if moved <= 0:
            raise OSError(errno.EIO, f"short {'read' if call is os.preadv else 'write'} at "
                          f"byte {offset + done} of an NVMe swap file")
        done += moved


def _check_directory(directory: Optional[str], section: str) -> str:
    key = f"{section}.nvme_path"
    if not directory:
        raise ConfigError(key, f'is required when {section.split(".")[-1]}.device is "nvme"')
    try:   # DeepSpeed creates the directory too
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError(key, f"{directory!r} does not exist and cannot be created "
                          f"({exc.strerror or exc})", value=directory) from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(key, f"{directory!r} is not writable by this process",
                          value=directory)
    return os.path.abspath(directory)
