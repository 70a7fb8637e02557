"""The one opener for files nobody here wrote: a regular file, inside its folder, of known size.

Every file a load, an import, a consolidation, the planner or the estimator reads goes
through :func:`open_file` (or a helper below built on it); tests/unit/test_hostile_files.py
scans the checkpoint, planner and estimate packages for any other way of opening one.

Note: what the opener checks
    * A regular file only: the file is opened non-blocking and ``fstat``-ed on the very
      descriptor later read, so a FIFO (whose read would block forever), a device such as
      ``/dev/zero`` (which never ends) or a socket is refused, even when swapped in after a
      check of the path.
    * Inside the folder given (``root``): the real path (symlinks resolved) must lie under
      the real path of ``root``; a symlink to another file of the folder is followed, one
      that leads out of it (to ``/etc/passwd``, to another job's weights) is refused. The
      resolved path is opened with ``O_NOFOLLOW``.
    * Size known before reading: ``max_bytes`` refuses a file larger than what its format
      may be, and :meth:`Opened.read` never reads past the size ``fstat`` gave, so the
      length a file's own metadata declares is bounded by the bytes really there.
    Libraries that want a path (``torch.load(mmap=True)``, ``safetensors.safe_open``) get
    :attr:`Opened.path_for_library`, ``/proc/self/fd/N``: the checked descriptor, not the
    name, which could be swapped meanwhile.

No torch here: the config layer uses it too. Each caller turns :class:`UnsafeFile` into its
own error (ConfigError, CheckpointError).
"""
from __future__ import annotations

import json
import os
import stat
from contextlib import contextmanager
from typing import Any, Iterator, Optional

_PROC_FD = "/proc/self/fd"
CONFIG_MAX_BYTES = 16 << 20   # a model's config.json is a few KB


class UnsafeFile(ValueError):
    """The file is not a regular file, lies outside its folder, is too large, or cannot be
    read (the message says which, naming the file)."""


class Opened:
    """A checked, open regular file: its descriptor, real path and size."""

    def __init__(self, path: str, fd: int, size: int, what: str) -> None:
        self.path, self.fd, self.size, self.what = path, fd, size, what

    @property
    def path_for_library(self) -> str:
        """A name for this descriptor for libraries that open by name (Linux:
        ``/proc/self/fd/N``; elsewhere the checked path)."""
        proc = f"{_PROC_FD}/{self.fd}"
        return proc if os.path.isdir(_PROC_FD) else self.path

    def read(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        """Bytes ``[offset, offset + length)`` (to the end when ``length`` is None); a range
        past the size the file had when opened raises :class:`UnsafeFile`."""
        if length is None:
            length = self.size - offset
        if offset < 0 or length < 0 or offset + length > self.size:
            raise UnsafeFile(f"{self.what} {self.path} is {self.size} bytes; bytes {offset}.."
                             f"{offset + length} lie past its end")
        chunks, done = [], 0
        try:
            while done < length:
                chunk = os.pread(self.fd, min(length - done, 1 << 24), offset + done)
                if not chunk:
                    break
                chunks.append(chunk)
                done += len(chunk)
        except OSError as exc:
            raise UnsafeFile(f"cannot read {self.what} {self.path}: "
                             f"{exc.strerror or exc}") from None
        if done != length:
            raise UnsafeFile(f"{self.what} {self.path} shrank while being read")
        return b"".join(chunks)

    def fileobj(self):
        """A seekable binary file object on the descriptor (not closing it), for ``zipfile``."""
        return os.fdopen(self.fd, "rb", closefd=False)


def inside(path: str, root: str) -> str:
    """The real path of ``path``, which must lie under the real path of ``root``."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    if real != top and not real.startswith(top.rstrip(os.sep) + os.sep):
        raise UnsafeFile(f"{path} resolves to {real}, outside the folder {root} it was read "
                         "from (a symlink out of it); refusing to read it")
    return real


@contextmanager
def open_file(path: str, *, what: str, root: Optional[str] = None,
              max_bytes: Optional[int] = None) -> Iterator[Opened]:
    """Open ``path`` for reading after the checks of Note: what the opener checks.
    FileNotFoundError when it is missing; :class:`UnsafeFile` for everything else."""
    if root is not None:   # a device or FIFO is named as such, wherever it lies
        try:
            _checked(os.stat(path), path, what, None)
        except OSError:
            pass   # missing or unreadable: the open below says which
        real = inside(path, root)
    else:
        real = path
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    if root is not None:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(real, flags)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(path) from None
    except OSError as exc:
        raise UnsafeFile(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        size = _checked(os.fstat(fd), path, what, max_bytes)
        yield Opened(path, fd, size, what)
    finally:
        os.close(fd)


def _checked(info: os.stat_result, path: str, what: str, max_bytes: Optional[int]) -> int:
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFile(f"{what} {path} is not a regular file (a FIFO, device or socket); "
                         "refusing to read it")
    if max_bytes is not None and info.st_size > max_bytes:
        raise UnsafeFile(f"{what} {path} is {info.st_size} bytes, more than the {max_bytes} "
                         "such a file can be; refusing to read it")
    return info.st_size


def check_regular_file(path: str, *, what: str, max_bytes: Optional[int] = None,
                       root: Optional[str] = None) -> int:
    """The size of ``path``, checked as :func:`open_file` checks it (the descriptor is
    closed again). FileNotFoundError when it is missing."""
    with open_file(path, what=what, root=root, max_bytes=max_bytes) as opened:
        return opened.size


def read_regular_file(path: str, *, what: str, max_bytes: int,
                      root: Optional[str] = None) -> bytes:
    """The bytes of regular file ``path`` (at most ``max_bytes``). A file that grows while
    read (``/proc`` files report size 0) is still read only up to ``max_bytes``.
    FileNotFoundError when it is missing."""
    with open_file(path, what=what, root=root, max_bytes=max_bytes) as opened:
        chunks, left = [], max_bytes + 1
        try:
            while left > 0:
                chunk = os.read(opened.fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as exc:
            raise UnsafeFile(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise UnsafeFile(f"{what} {path} is longer than {max_bytes} bytes; refusing to read it")
    return data


def read_json(path: str, *, what: str, max_bytes: int, root: Optional[str] = None) -> Any:
    """The JSON value in ``path`` (read as :func:`read_regular_file`); text that is not
    JSON, nested too deep or with huge numbers raises :class:`UnsafeFile` naming the file."""
    data = read_regular_file(path, what=what, max_bytes=max_bytes, root=root)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise UnsafeFile(f"{what} {path} is not valid JSON: {exc}") from None


def read_text(path: str, *, what: str, max_bytes: int, root: Optional[str] = None) -> str:
    """The UTF-8 text of ``path`` (undecodable bytes replaced)."""
    return read_regular_file(path, what=what, max_bytes=max_bytes,
                             root=root).decode("utf-8", errors="replace")


@contextmanager
def open_safetensors(path: str, *, what: str, root: Optional[str] = None,
                     max_header_bytes: int) -> Iterator[Any]:
    """``safetensors.safe_open`` on ``path`` after the opener's checks and a check that the
    header it declares is at most ``max_header_bytes`` (parsing a million entries costs the
    library ~10 s and ~1.2 GB). The library's own errors pass through."""
    from safetensors import safe_open
    with open_file(path, what=what, root=root) as opened:
        head = opened.read(0, min(8, opened.size))
        declared = int.from_bytes(head, "little") if len(head) == 8 else 0
        if declared > max_header_bytes:
            raise UnsafeFile(f"{what} {path} declares a header of {declared} bytes, more than "
                             f"the {max_header_bytes} such a file needs; refusing to parse it")
        handle = safe_open(opened.path_for_library, framework="pt", device="cpu")
    with handle as entered:   # the library holds its own mapping of the checked file
        yield entered
