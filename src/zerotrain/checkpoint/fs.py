"""The save directory: tags, the ``latest`` file, and atomic publication of a tag.

Note: atomic publication
    A tag is written into ``<save_dir>/.tmp-<tag>-<nonce>``; every file is fsynced there.
    Rank 0 then fsyncs the directory and renames it to ``<tag>``, fsyncs ``save_dir``, and
    only then rewrites ``latest`` (a temp file, fsynced, ``os.replace``d). So at any
    instant ``latest`` names a complete tag, and a half-written tag only ever exists under a
    ``.tmp-`` name, which loading never looks at and the next save deletes.

    Re-saving an existing tag cannot be one rename (POSIX cannot swap two non-empty
    directories portably): the old tag is first renamed to ``.old-<tag>-<nonce>``, then the
    new one moved in, then the old one deleted. A crash between the two renames leaves only
    ``.old-<tag>-<nonce>``; loading falls back to it and the next save renames it back.

Note: one save at a time
    Rank 0 holds an exclusive ``fcntl.flock`` on ``<save_dir>/.zerotrain-save.lock`` from
    :func:`prepare` (which deletes what earlier saves left) until the save returns
    (:func:`unlock`). A second job saving into the same directory meanwhile does not wait: its
    save fails on every one of its ranks with a CheckpointError naming the directory and the
    holder's pid, and the first job's temp directory and tags are never touched. The holder
    deletes the lock file before it lets go, so no file stays behind between saves; whoever
    locks a file that has been deleted meanwhile sees so (inode check) and starts over. The
    kernel drops the lock when its process dies: a killed save leaves an unlocked file, which
    the next save takes. On a filesystem without ``flock`` support the save goes on without
    the guard, after a warning.

Note: crash points (tests only)
    ``ZEROTRAIN_CHECKPOINT_CRASH_AT=<point>`` makes the saving process SIGKILL itself at that
    point: ``file`` (after its first file is written into the temp directory), ``swap``
    (between moving an existing tag aside and moving the new one in), ``latest`` (after the
    rename, before ``latest`` is rewritten), ``background`` (an asynchronous save's writer
    thread, after its rank file is written). tests/dist/test_checkpoint.py uses it to check
    that a save killed at any of these points leaves the previous checkpoint loadable.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
from typing import Callable, Optional

from .manifest import (LATEST_NAME, MANIFEST_MAX_BYTES, MANIFEST_NAME, CheckpointError,
                       check_tag, read_regular_file)
from .. import untrusted
from .stfile import fsync_path

logger = logging.getLogger(__name__)

CRASH_ENV = "ZEROTRAIN_CHECKPOINT_CRASH_AT"
_TMP, _OLD = ".tmp-", ".old-"
LOCK_NAME = ".zerotrain-save.lock"
LATEST_MAX_BYTES = 4096
_held_locks: dict[str, tuple[int, str]] = {}   # realpath(save_dir) -> (fd, lock file)


def crash_point(name: str) -> None:
    """SIGKILL this process if the test hook asks for a crash here (Note: crash points)."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def new_nonce() -> str:
    return secrets.token_hex(6)


def temp_dir(save_dir: str, tag: str, nonce: str) -> str:
    return os.path.join(save_dir, f"{_TMP}{tag}-{nonce}")


# --------------------------------------------------------------------------- reading
def read_latest_text(save_dir: str) -> Optional[str]:
    """The text of ``save_dir/latest``, stripped; None when there is none.

    Only a regular file of at most :data:`LATEST_MAX_BYTES` bytes of UTF-8 is read: a FIFO,
    a device such as ``/dev/zero`` or a huge file raises CheckpointError instead of hanging
    or exhausting memory (:func:`read_regular_file`).
    """
    path = os.path.join(save_dir, LATEST_NAME)
    try:
        data = read_regular_file(path, what="'latest' file", max_bytes=LATEST_MAX_BYTES,
                                 root=save_dir)
    except FileNotFoundError:
        return None
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text") from None


def read_latest(save_dir: str) -> Optional[str]:
    """The tag ``latest`` names, or None when there is no ``latest`` file."""
    tag = read_latest_text(save_dir)
    if tag is None:
        return None
    try:
        return check_tag(tag)
    except CheckpointError as exc:   # say which file named it (an empty or edited latest)
        raise CheckpointError(f"{os.path.join(save_dir, LATEST_NAME)}: {exc}") from None


def resume_candidates(save_dir: str, *,
                      other_steps: Optional[Callable[[str], Optional[int]]] = None
                      ) -> tuple[list[str], list[str]]:
    """Tags to resume from, best first, and notes on what was left out.

    The tag ``latest`` names comes first (whatever it is, so a reader of another format can
    try it), then every other tag directory holding a ``manifest.json``, by its
    ``counters.global_steps``, newest first. ``other_steps(path)`` gives the step count of
    another format's tag directory, None when ``path`` is not one (DeepSpeed's
    ``global_stepN``: ``deepspeed.files.tag_steps``); those are ordered by it with the rest.
    Directories of neither kind are not candidates; they are only noted.
    """
    notes: list[str] = []
    named = None
    try:
        named = read_latest(save_dir)
    except CheckpointError as exc:
        notes.append(f"'latest': {exc}")
    found = []
    for entry in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, entry)
        if entry.startswith(".") or entry == named or not os.path.isdir(path):
            continue
        steps = _global_steps(path)
        if steps is None and other_steps is not None:
            steps = other_steps(path)
        if steps is None:
            notes.append(f"{entry}: no readable {MANIFEST_NAME}")
        else:
            found.append((steps, os.path.getmtime(path), entry))
    ordered = [entry for *_, entry in sorted(found, reverse=True)]
    return ([named] if named else []) + ordered, notes


def _global_steps(tag_path: str) -> Optional[int]:
    try:   # bounded and non-blocking: a FIFO or /dev/zero here is just not a candidate
        data = read_regular_file(os.path.join(tag_path, MANIFEST_NAME), what="manifest",
                                 max_bytes=MANIFEST_MAX_BYTES, root=tag_path)
        steps = json.loads(data)["counters"]["global_steps"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError, CheckpointError):
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def tag_dir(save_dir: str, tag: str) -> Optional[str]:
    """Where tag ``tag`` lives: ``save_dir/tag``, or the ``.old-`` copy a save crashed in the
    middle of replacing (Note: atomic publication); None if neither is complete."""
    path = os.path.join(save_dir, check_tag(tag))
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return path
    if os.path.isdir(save_dir):
        for entry in sorted(os.listdir(save_dir)):
            if _old_tag(entry) == tag and os.path.isfile(
                    os.path.join(save_dir, entry, MANIFEST_NAME)):
                return os.path.join(save_dir, entry)
    return None


def _old_tag(entry: str) -> Optional[str]:
    if not entry.startswith(_OLD) or "-" not in entry[len(_OLD):]:
        return None
    return entry[len(_OLD):].rsplit("-", 1)[0]


# --------------------------------------------------------------------------- writing
def lock(save_dir: str) -> None:
    """Take this directory's save lock or raise CheckpointError (Note: one save at a time)."""
    unlock(save_dir)   # a lock left by an earlier failed save of this process
    path = os.path.join(save_dir, LOCK_NAME)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):   # no locks on this filesystem
                logger.warning("cannot lock %s (%s): saving without the one-save-at-a-time "
                               "guard", path, exc.strerror or exc)
                return
            raise CheckpointError(f"another process (pid {holder}) is saving a checkpoint "
                                  f"into {save_dir} right now; two jobs must not save into "
                                  "one directory (give each its own save_dir)") from None
        if _same_file(fd, path):   # not unlinked by the holder we waited for: ours
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held_locks[os.path.realpath(save_dir)] = (fd, path)


def _holder(fd: int) -> str:
    """The pid of the process holding the lock on ``fd``'s file: what it wrote there, else
    (it took the lock and has not written yet) the kernel's record in /proc/locks."""
    written = os.pread(fd, 32, 0).decode(errors="replace").strip()
    if written:
        return written
    info = os.fstat(fd)
    inode = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        text = untrusted.read_text("/proc/locks", what="kernel lock table", max_bytes=64 << 20)
    except (OSError, untrusted.UnsafeFile):
        return "unknown"
    for line in text.splitlines():
        fields = line.split()
        if "FLOCK" in fields and inode in fields and "->" not in fields:
            return fields[fields.index(inode) - 1]
    return "unknown"


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def unlock(save_dir: str) -> None:
    """Release this process's save lock on ``save_dir`` if it holds one (every rank may call):
    the lock file is removed while still locked, so the directory keeps no trace of it."""
    held = _held_locks.pop(os.path.realpath(save_dir), None)
    if held is not None:
        fd, path = held
        try:
            os.remove(path)
        except OSError:
            pass
        os.close(fd)   # closing the descriptor drops the flock


def prepare(save_dir: str, tag: str, nonce: str) -> str:
    """Rank 0, before any rank writes: take the save lock, tidy what earlier crashed saves
    left, then create and return the empty temp directory for this save."""
    os.makedirs(save_dir, exist_ok=True)
    lock(save_dir)
    for entry in os.listdir(save_dir):
        path = os.path.join(save_dir, entry)
        if entry.startswith(_TMP):
            logger.info("removing %s, left by an interrupted checkpoint save", path)
            remove_quietly(path)
        elif _old_tag(entry) is not None:
            original = os.path.join(save_dir, _old_tag(entry))
            if os.path.exists(original):
                shutil.rmtree(path, ignore_errors=True)
            else:
                logger.info("restoring %s, left by an interrupted checkpoint save", original)
                os.rename(path, original)
    tmp = temp_dir(save_dir, tag, nonce)
    os.makedirs(tmp)
    return tmp


def publish(save_dir: str, tmp: str, tag: str, nonce: str, *, save_latest: bool) -> str:
    """Rank 0, after every file is written and fsynced: move the tag into place, then point
    ``latest`` at it (Note: atomic publication). Returns the tag's path."""
    fsync_path(tmp)
    final = os.path.join(save_dir, tag)
    old = None
    if os.path.exists(final):
        old = os.path.join(save_dir, f"{_OLD}{tag}-{nonce}")
        os.rename(final, old)
        crash_point("swap")
    os.rename(tmp, final)
    fsync_path(save_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    crash_point("latest")
    if save_latest:
        write_latest(save_dir, tag, nonce)
    unlock(save_dir)   # published: the next save may start
    return final


def write_latest(save_dir: str, tag: str, nonce: str) -> None:
    temp = os.path.join(save_dir, f"{_TMP}{LATEST_NAME}-{nonce}")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        remove_quietly(temp)
        raise CheckpointError(f"cannot write {temp}: {exc.strerror or exc}") from exc
    os.replace(temp, os.path.join(save_dir, LATEST_NAME))
    fsync_path(save_dir)


def remove_quietly(path: str) -> None:
    """Best-effort removal of a temp directory (or temp file) of a failed save."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except OSError:
            pass


def require_dir(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} exists and is not a directory")
