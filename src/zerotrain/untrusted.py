"""Opening a file nobody here wrote: only a regular file, of bounded size.

A FIFO blocks its reader forever and ``/dev/zero`` never ends, so every file zerotrain
reads from a checkpoint or a config is checked here first (``latest``, ``manifest.json``,
DeepSpeed's ``.pt`` files, the config file). No torch: the config layer uses it too; each
caller turns :class:`UnsafeFile` into its own error (ConfigError, CheckpointError).
"""
from __future__ import annotations

import os
import stat
from typing import Optional


class UnsafeFile(ValueError):
    """The file is not a regular file, is too large, or cannot be read (the message says
    which, naming the file)."""


def check_regular_file(path: str, *, what: str, max_bytes: Optional[int] = None) -> int:
    """The size of ``path``, checked without opening it (a FIFO's open would block) to be a
    regular file of at most ``max_bytes`` bytes. FileNotFoundError when it is missing."""
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(path) from None
    except OSError as exc:
        raise UnsafeFile(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    return _checked(info, path, what, max_bytes)


def _checked(info: os.stat_result, path: str, what: str, max_bytes: Optional[int]) -> int:
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFile(f"{what} {path} is not a regular file (a FIFO, device or socket); "
                         "refusing to read it")
    if max_bytes is not None and info.st_size > max_bytes:
        raise UnsafeFile(f"{what} {path} is {info.st_size} bytes, more than the {max_bytes} "
                         "such a file can be; refusing to read it")
    return info.st_size


def read_regular_file(path: str, *, what: str, max_bytes: int) -> bytes:
    """The bytes of regular file ``path`` (at most ``max_bytes``), opened non-blocking and
    checked with ``fstat`` on the descriptor read, so a file swapped for a FIFO between a
    check and the read still cannot block. FileNotFoundError when it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(path) from None
    except OSError as exc:
        raise UnsafeFile(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    chunks: list[bytes] = []
    try:
        _checked(os.fstat(fd), path, what, max_bytes)
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise UnsafeFile(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise UnsafeFile(f"{what} {path} is longer than {max_bytes} bytes; refusing to read it")
    return data
