"""Host tensors for offloaded state: pinned RAM, or files under ``nvme_path``.

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

Note: storage questions
    A stage never asks which storage it holds. What differs between the device, host memory
    and NVMe is a method of the :class:`Storage` protocol: where its tensors are counted
    (``memory_category``), whether training tensors may alias them (``can_alias``), whether
    the optimizer over them steps on the host (``steps_on_host``, which also picks the
    updater and the optimizer's device), how a parameter-dtype shard kept here follows its
    master (``fill_from_master``), and what to wait for before rewriting them
    (``finish_sends``).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import queue
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ContextManager, Optional, Protocol, Sequence

import torch

from ..errors import ConfigError
from ..core.log import ALL_RANKS
from .plan import OffloadPlan
from .traffic import nbytes
from .transfers import Transfers

OPTIMIZER_SECTION = "zero_optimization.offload_optimizer"
logger = logging.getLogger(__name__)
_IO_CHUNK = 1 << 30  # bytes per preadv/pwrite call (Linux caps one call near 2 GiB)


def _pinnable(pin: bool) -> bool:
    return bool(pin) and torch.cuda.is_available()


class Storage(Protocol):
    """Where a stage's fp32 masters (or stage 3's parameter shards) live, and what follows
    from that. Stages ask it rather than inspect it (Note "storage questions")."""

    transfers: Transfers

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new tensor of ``numel`` elements of ``dtype``, allocated here."""

    def send(self, shard: torch.Tensor, device: torch.device
             ) -> tuple[torch.Tensor, ContextManager]:
        """``shard`` (kept here) on ``device`` for a collective, and the context to launch
        it in."""

    def upload(self, master: torch.Tensor, dtype: torch.dtype,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``master`` (kept here) as ``dtype`` on the device, or written into ``out``."""

    def memory_category(self, role: str) -> str:
        """The ``memory_breakdown`` category of ``role``'s tensors kept here (``"parameters"``
        is ``"host_parameters"`` in host memory)."""

    def can_alias(self) -> bool:
        """Whether training tensors (parameters, parameter-dtype shards) may be views of the
        tensors kept here instead of copies: only when those live on the training device."""

    def steps_on_host(self) -> bool:
        """Whether the optimizer over the tensors kept here runs on the host, one record at
        a time (offload/updater.py), rather than on the device in one call."""

    def finish_sends(self) -> None:
        """Wait for copies still reading the tensors kept here (sent up for the last
        backward), before those tensors are rewritten."""

    def fill_from_master(self, out: torch.Tensor, master: torch.Tensor, *,
                         master_storage: "Storage") -> None:
        """Write ``master``'s values (fp32, kept in ``master_storage``) into ``out``, a
        parameter-dtype shard kept here."""

    def close(self) -> None:
        """Release what the storage holds beyond its tensors (pins, files, threads)."""


class DeviceStorage:
    """No offload: state is allocated on the training device, where it is used."""

    def __init__(self, device: torch.device, transfers: Optional[Transfers] = None) -> None:
        self.device = torch.device(device)
        self.transfers = transfers or Transfers(self.device)

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def send(self, shard: torch.Tensor, device: torch.device):
        """``shard`` on ``device`` for a collective, and the context to launch it in."""
        return shard.to(device), contextlib.nullcontext()

    def upload(self, master: torch.Tensor, dtype: torch.dtype,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``master`` (kept here, on the device) as ``dtype`` on the device, or into ``out``."""
        return master.to(dtype) if out is None else out.copy_(master)

    def memory_category(self, role: str) -> str:
        return role

    def can_alias(self) -> bool:
        return True

    def steps_on_host(self) -> bool:
        return False

    def finish_sends(self) -> None:
        """Copies from the device are ordered on its stream: nothing to wait for."""

    def fill_from_master(self, out: torch.Tensor, master: torch.Tensor, *,
                         master_storage: Storage) -> None:
        """The master's storage sends it up (in fp32 from the host, cast on the device)."""
        master_storage.upload(master, out.dtype, out=out)

    def close(self) -> None:
        pass


class HostStorage:
    """State in host RAM, pinned when asked (and CUDA exists): always resident.

    Pinned state is ordinary memory page-locked with ``cudaHostRegister`` rather than taken
    from torch's pinned allocator, which rounds every block up to a power of two: for
    state that is most of the host's memory, that rounding could nearly double it.
    """

    category_prefix = "host_"   # memory_breakdown: host_optimizer_state, host_parameters
    swaps = False

    def __init__(self, pin_memory: bool = False, transfers: Optional[Transfers] = None) -> None:
        self.pin = _pinnable(pin_memory)
        self._registered: list[torch.Tensor] = []
        self.transfers = transfers or Transfers(torch.device("cpu"))

    def send(self, shard: torch.Tensor, device: torch.device):
        """``shard`` (host) on ``device``, copied on the side stream, and the context to
        launch its collective in (Note "copy streams" in transfers.py)."""
        return self.transfers.send(shard, device)

    def upload(self, master: torch.Tensor, dtype: torch.dtype,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``master`` (fp32, kept here) as ``dtype`` on the device: fp32 crosses and the
        device casts (Note "the host does only Adam" in transfers.py)."""
        return self.transfers.upload(master, dtype, out)

    def memory_category(self, role: str) -> str:
        return self.category_prefix + role

    def can_alias(self) -> bool:
        return False

    def steps_on_host(self) -> bool:
        return True

    def finish_sends(self) -> None:
        """Host tensors may still be read by queued host-to-device copies: let them land."""
        self.transfers.synchronize()

    def fill_from_master(self, out: torch.Tensor, master: torch.Tensor, *,
                         master_storage: Storage) -> None:
        """Host to host: parameters on the host need their masters on the host too
        (offload/plan.py); the one 16-bit write per parameter (Note "host traffic")."""
        out.copy_(master)
        self.transfers.host.record("param_fill", read=nbytes(master), written=nbytes(out))

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not self.pin or numel == 0:
            return torch.zeros(numel, dtype=dtype)
        # whole pages of its own: cudaHostRegister refuses a page that is registered already,
        # and two small tensors from the heap may share one
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        span = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        raw = torch.zeros(span + mmap.PAGESIZE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % mmap.PAGESIZE
        pages = raw[start: start + span]
        self._register(pages)
        return pages[:nbytes].view(dtype)

    def _register(self, pages: torch.Tensor) -> None:
        nbytes = pages.numel()
        status = torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), nbytes, 1)  # portable
        if int(status) != 0:
            logger.warning("could not page-lock %.2f GiB of offloaded state (CUDA error %s); "
                           "it stays pageable, and its copies synchronous", nbytes / 2**30,
                           int(status))
            return
        self._registered.append(pages)

    def staging(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A transfer buffer (pinned when possible, so copies can be asynchronous)."""
        return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())

    # the swap protocol, trivially: everything is always in memory
    def prefetch(self, key: int, tensors: Sequence[torch.Tensor]) -> None:
        pass

    def swap_in(self, key: int) -> None:
        pass

    def swap_out(self, key: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def abort(self) -> None:
        """After a failed step: nothing is swapped, nothing to undo."""

    def close(self) -> None:
        """Unlock pinned state (the tensors stay valid, pageable)."""
        if self._registered:
            torch.cuda.synchronize()   # no copy from it may still be in flight
        for tensor in self._registered:
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        self._registered.clear()


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


def build_storage(plan: OffloadPlan, rank: int, device: torch.device,
                  transfers: Optional[Transfers] = None) -> Storage:
    """Where fp32 masters and optimizer state live: the device, host memory or NVMe.
    ``transfers`` issues and counts its copies (one per stage, shared by its storages)."""
    if plan.optimizer == "nvme":
        # the slots are few and bounded, so they are always pinned
        return NvmeStorage(plan.nvme_path, rank, slots=plan.buffer_count, pin_memory=True,
                           transfers=transfers)
    if plan.optimizer_offloaded:
        return HostStorage(plan.pin_memory, transfers)
    return DeviceStorage(device, transfers)


def place_masters(plan: OffloadPlan, storage: Storage, device: Storage,
                  records: Sequence[int]) -> list[Storage]:
    """Stage 3: where each unit's fp32 masters live, for units of ``records[u]`` records
    each, in layout order (Note "partial offload" in updater.py). With
    ``offload_optimizer.ratio`` below 1 the first ``plan.records_on_device`` records stay
    on the device, rounded down to whole units (a unit's masters are one tensor), so the
    device never holds more than the ratio leaves it; the other units' masters live in
    ``storage``."""
    if not plan.optimizer_offloaded:
        return [storage] * len(records)
    kept = plan.records_on_device(sum(records))
    out, first = [], 0
    for count in records:
        first += count
        out.append(device if first <= kept else storage)
    return out


def build_param_storage(plan: OffloadPlan, rank: int, device: torch.device,
                        transfers: Optional[Transfers] = None) -> Storage:
    """Where stage-3 parameter shards live between uses: the device, host memory (pinned
    when asked), or files under ``offload_param.nvme_path``, read through the page cache
    when a unit is gathered."""
    if plan.param == "nvme":
        return NvmeStorage(plan.param_nvme_path, rank, section="zero_optimization.offload_param",
                           label="params", transfers=transfers)
    if plan.param_offloaded:
        return HostStorage(plan.param_pin_memory, transfers)
    return DeviceStorage(device, transfers)
