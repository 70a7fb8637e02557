"""The asynchronous save's two halves: a reused staging buffer and one background writer.

Note: asynchronous save
    ``save_checkpoint(..., writer=...)`` does the collective part of a save in the training
    thread (the metadata gather, rank 0's temp directory and lock), copies everything the
    save writes into :class:`StagingBuffer` (host memory, pinned when the tensors live on a
    GPU) and returns. :class:`BackgroundWriter` then writes the rank file from the copy on
    one thread, and rank 0's thread publishes the tag with the synchronous save's atomic
    protocol (Note: atomic publication in ``fs.py``). The threads never call a collective:
    each rank reports through a small marker file in the temp directory
    (:func:`write_marker`), which rank 0 waits for (:func:`wait_markers`).

    At most one save is in flight: the buffer is reused, so a new save (or a load) first
    waits for the previous one (:meth:`BackgroundWriter.wait`, collective, which also raises
    on every rank the first error any rank's writer met). Before the writer starts, every
    rank reports whether it staged its state (one gather): where one could not, no writer
    starts on any rank, rank 0 removes the temp directory, and every rank raises; so every
    rank has the same save pending, and ``wait`` is collective whether or not this rank has
    one. At interpreter exit an unfinished
    save is waited for; interrupted again (a second Ctrl-C), it is abandoned: rank 0 removes
    the temp directory and never publishes. A process killed meanwhile leaves only a
    ``.tmp-`` directory, which loading and auto-resume never look at and the next save
    deletes, so ``latest`` still names the previous complete tag.

Note: writer outcomes are exchanged
    A rank's writer reports its own file's outcome (written, or why not) to ``wait`` as soon
    as it knows it; ``wait`` first exchanges these outcomes (one gather) and only then joins
    rank 0's thread. Where any rank failed, rank 0's thread is told to stop waiting for the
    markers (``abandon``): it removes the temp directory and publishes nothing, and every
    rank raises that rank's own error (``No space left on device``), at once rather than
    after ``comms_timeout``. A marker that cannot be written is a failure like the file's;
    the failing rank then leaves an empty ``.rank<r>.failed`` file where it can (an empty
    file needs no data block, so a full disk usually still takes it), which rank 0's thread
    takes as that rank's failure when nobody calls ``wait`` (interpreter exit). Otherwise
    rank 0 joins its thread (which publishes) and a second gather gives every rank its
    outcome.

Note: saves in flight per directory
    Two engines of one process (an actor and a critic, a GAN's two networks) may save into
    one directory. Rank 0's save lock is taken per process (Note "one save at a time" in
    ``fs.py``), so a second save there would take the first's lock and delete its temp
    directory as an interrupted save's. This process's saves in flight are therefore
    registered by directory (:func:`wait_for_directory`): a new save into a directory whose
    save is still being written waits for that writer's thread first (not collective: the
    thread needs no other rank to finish; its outcome stays for its own engine's ``wait``).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import weakref
from typing import Callable, Optional

import torch

from .. import untrusted
from .manifest import CheckpointError

logger = logging.getLogger(__name__)

_ALIGN = 64   # every staged tensor starts on a 64-byte boundary
MARKER_SUFFIX = ".written"
_MARKER_MAX_BYTES = 1 << 16   # {"size": N, "error": one line}
FAILED_SUFFIX = ".failed"
Report = Callable[[Optional[str]], None]   # a writer's own outcome: None, or its error


class StagingBuffer:
    """One host buffer every save copies into, grown only when a save needs more.

    Pinned when a staged tensor is on a GPU (copies then run at full PCIe speed); the bytes
    it holds are what the background writer writes, so it is reused only after the previous
    save's writer is done (:class:`BackgroundWriter` guarantees it)."""

    def __init__(self) -> None:
        self._storage: Optional[torch.Tensor] = None
        self._pinned = False

    @property
    def nbytes(self) -> int:
        return 0 if self._storage is None else self._storage.numel()

    def stage(self, items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Copy ``items`` into the buffer; returns views with the same keys, dtypes, shapes."""
        offsets, total = [], 0
        for _, tensor in items:
            offsets.append(total)
            total += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        pin = torch.cuda.is_available() and any(t.is_cuda for _, t in items)
        if self._storage is None or self.nbytes < total or (pin and not self._pinned):
            self._storage = None   # let the old buffer go before the new one is allocated
            self._storage = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
            self._pinned = pin
        staged: dict[str, torch.Tensor] = {}
        for (key, tensor), offset in zip(items, offsets):
            nbytes = tensor.numel() * tensor.element_size()
            view = self._storage[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach(), non_blocking=pin)
            staged[key] = view
        if pin:
            torch.cuda.synchronize()   # the writer thread reads these bytes
        return staged


class BackgroundWriter:
    """Runs one save's writing on a thread; at most one at a time (Note: asynchronous save)."""

    def __init__(self) -> None:
        self.buffer = StagingBuffer()
        self.abandon = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        self._own = threading.Event()        # this rank's own file: outcome known
        self._own_error: Optional[str] = None
        self._what = ""
        self._pending = False
        _live.add(self)

    @property
    def pending(self) -> bool:
        """A save was started and its outcome not yet collected by :meth:`wait`."""
        return self._pending

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: Callable[[threading.Event, Report], None], what: str,
              directory: Optional[str] = None) -> None:
        """Run ``job(abandon, report)`` on the writer thread (``report(error)``: this rank's
        own file is written, or why not: Note "writer outcomes are exchanged"); the caller
        has waited for the last. ``directory``: registered while the thread runs (Note
        "saves in flight per directory")."""
        if self._pending:
            raise CheckpointError("a checkpoint save is already in flight; wait for it first")
        self._error, self._what, self._pending = None, what, True
        self._own_error = None
        self._own.clear()
        self.abandon.clear()
        key = None if directory is None else _directory_key(directory)
        self._thread = threading.Thread(target=self._run, args=(job, key), daemon=True,
                                        name="zerotrain-checkpoint-writer")
        if key is not None:
            with _registry_lock:
                _in_flight.setdefault(key, []).append(self)
        self._thread.start()

    def _report(self, error: Optional[str]) -> None:
        if not self._own.is_set():
            self._own_error = error
            self._own.set()

    def _run(self, job: Callable[[threading.Event, Report], None],
             key: Optional[str]) -> None:
        try:
            job(self.abandon, self._report)
        except (CheckpointError, OSError) as exc:
            self._error = str(exc)
            logger.error("background checkpoint save of %s failed: %s", self._what, exc)
        except BaseException as exc:   # never lose a failure on a thread nobody joins
            self._error = f"{type(exc).__name__}: {exc}"
            logger.exception("background checkpoint save of %s failed", self._what)
        finally:
            self._report(self._error or "its writer ended before its file was written")
            if key is not None:
                with _registry_lock:
                    writers = _in_flight.get(key, [])
                    if self in writers:
                        writers.remove(self)
                    if not writers:
                        _in_flight.pop(key, None)

    def join(self) -> Optional[str]:
        """Wait for this rank's writer (not collective); its error, if any."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        return self._error

    def wait(self, comm, *, debug: bool = False) -> None:
        """Collective, whether or not a save is pending here: every rank reports its own
        file's outcome, then rank 0's thread publishes (or, where any rank failed, is told
        to stop), then all raise the first error any rank's writer met, the same message
        everywhere (Note: writer outcomes are exchanged)."""
        pending = self._pending
        if self.in_flight and debug:
            logger.info("waiting for the checkpoint save of %s still in flight", self._what)
        own = None
        if pending:
            self._own.wait()
            own = None if self._own_error is None else f"rank {comm.rank}: {self._own_error}"
        everyone = comm.all_gather_object({"pending": pending, "error": own},
                                          label="checkpoint save: background writers")
        errors = [e["error"] for e in everyone if e["error"]]
        if len({e["pending"] for e in everyone}) > 1:
            errors.append("ranks disagree on whether a save is in flight (ranks "
                          f"{[r for r, e in enumerate(everyone) if e['pending']]} have one)")
        if errors:
            self.abandon.set()   # rank 0's thread stops waiting for the markers
        error = self.join()
        self._pending = False
        if not errors and any(e["pending"] for e in everyone):
            final = {"error": None if error is None else f"rank {comm.rank}: {error}"}
            everyone = comm.all_gather_object(final, label="checkpoint save: publication")
            errors = [e["error"] for e in everyone if e["error"]]
        if errors:
            raise CheckpointError(f"the background checkpoint save of {self._what} failed "
                                  f"and was not published: {errors[0]}")

    def close_at_exit(self) -> None:
        """Interpreter exit: wait for an unfinished save; a second interrupt abandons it."""
        if not self.in_flight:
            return
        logger.warning("waiting for the checkpoint save of %s to finish before exiting "
                       "(interrupt again to abandon it; it is then never published)",
                       self._what)
        try:
            self.join()
        except KeyboardInterrupt:
            self.abandon.set()
            logger.warning("abandoning the checkpoint save of %s", self._what)
            if self._thread is not None:
                self._thread.join(timeout=60)


# Note "saves in flight per directory": realpath(save_dir) -> the writers writing there
_in_flight: dict[str, list[BackgroundWriter]] = {}
_registry_lock = threading.Lock()


def _directory_key(directory: str) -> str:
    return os.path.realpath(os.fspath(directory))


def wait_for_directory(directory: str) -> None:
    """Wait for every save of this process still being written into ``directory`` (its
    writer thread: not collective); their outcomes stay for their own ``wait``."""
    key = _directory_key(directory)
    while True:
        with _registry_lock:
            writers = [w for w in _in_flight.get(key, []) if w.in_flight]
        if not writers:
            return
        for writer in writers:
            logger.info("waiting for the checkpoint save of %s, still being written into "
                        "%s, before the next save there", writer._what, directory)
            thread = writer._thread
            if thread is not None:
                thread.join()


_live: "weakref.WeakSet[BackgroundWriter]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for writer in list(_live):
        writer.close_at_exit()


# --------------------------------------------------------------------------- markers
def marker_name(rank: int) -> str:
    return f".rank{rank:05d}{MARKER_SUFFIX}"


def write_marker(tmp: str, rank: int, size: int, error: Optional[str]) -> None:
    """Tell rank 0 this rank's file is written (``size`` bytes) or why it is not; the marker
    appears at once (written aside, then renamed), so rank 0 never reads half of one."""
    path = os.path.join(tmp, marker_name(rank))
    with open(path + ".part", "w", encoding="utf-8") as f:
        json.dump({"size": size, "error": error}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def mark_failed(tmp: str, rank: int) -> None:
    """Best effort, never raises: an empty ``.rank<r>.failed`` file, for when the marker
    itself cannot be written (Note: writer outcomes are exchanged)."""
    try:
        os.close(os.open(os.path.join(tmp, f".rank{rank:05d}{FAILED_SUFFIX}"),
                         os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError:
        pass


def wait_markers(tmp: str, world: int, abandon: threading.Event,
                 timeout: float) -> list[dict]:
    """Rank 0: every rank's marker, in rank order, once all are there. Raises CheckpointError
    when abandoned or when a rank has not reported within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    found: dict[int, dict] = {}
    delay = 0.001
    while len(found) < world:
        for rank in range(world):
            if rank in found:
                continue
            try:
                found[rank] = untrusted.read_json(os.path.join(tmp, marker_name(rank)),
                                                  what="rank marker", root=tmp,
                                                  max_bytes=_MARKER_MAX_BYTES)
            except FileNotFoundError:
                if os.path.exists(os.path.join(tmp, f".rank{rank:05d}{FAILED_SUFFIX}")):
                    found[rank] = {"size": 0, "error": f"rank {rank} could not write its file "
                                   "or its marker (its error is in its log)"}
            except (OSError, ValueError) as exc:   # UnsafeFile is a ValueError
                found[rank] = {"size": 0, "error": f"unreadable marker: {exc}"}
        if len(found) == world:
            break
        if abandon.is_set():
            raise CheckpointError("abandoned before every rank had written its file (a "
                                  "rank failed, or interpreter exit)")
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(found))
            raise CheckpointError(f"ranks {missing} did not finish writing their files into "
                                  f"{tmp} within {timeout:g} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    for rank in range(world):
        for name in (marker_name(rank), f".rank{rank:05d}{FAILED_SUFFIX}"):
            try:
                os.remove(os.path.join(tmp, name))
            except FileNotFoundError:
                pass
    return [found[rank] for rank in range(world)]
