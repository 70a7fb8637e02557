"""safetensors files: a streaming writer and a reader whose errors name the file.

Note: why our own writer
    ``safetensors.torch.save_file`` first turns every tensor into ``bytes`` and then
    serialises the whole dict, so writing a shard costs a second copy of it in host memory,
    and exporting a model would hold a whole output file. The format is simple enough to
    stream: an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
    shape and byte range, then the raw little-endian bytes back to back. :func:`write_file`
    writes the header from the specs, then each tensor as it is produced, and fsyncs. Reading
    always goes through the ``safetensors`` library (``safe_open``), which validates the
    header and never unpickles anything, opened through the one opener
    (``untrusted.open_safetensors``: a regular file inside the tag, header size bounded).
"""
from __future__ import annotations

import json
import os
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from safetensors import SafetensorError

from .. import untrusted
from .manifest import CheckpointError

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
_ALIGN = 8  # the header is padded with spaces so the data starts 8-byte aligned
MAX_HEADER_BYTES = 16 << 20   # ~200k tensors; a checkpoint file holds far fewer (parsing a
                              # million entries costs the library ~10 s and ~1.2 GB)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a file to be written: its key, dtype and shape, known before its data."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in a safetensors checkpoint")
    return DTYPE_NAMES[dtype]


def write_file(path: str, specs: list[TensorSpec], produce: Callable[[TensorSpec], torch.Tensor],
               *, metadata: Optional[dict[str, str]] = None) -> int:
    """Write ``specs`` to ``path``, asking ``produce(spec)`` for each tensor in turn.

    Only one produced tensor is alive at a time. The file is fsynced before returning.
    Returns the file size in bytes.
    """
    header: dict = {"__metadata__": dict(metadata or {})}
    offset = 0
    for spec in specs:
        if spec.key in header:
            raise CheckpointError(f"{path}: tensor {spec.key!r} is written twice")
        header[spec.key] = {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _ALIGN)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for spec in specs:
                tensor = produce(spec)
                if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                    raise CheckpointError(f"{path}: tensor {spec.key!r} is {tensor.dtype} "
                                          f"{tuple(tensor.shape)}, expected {spec.dtype} "
                                          f"{spec.shape}")
                f.write(_raw_bytes(tensor))
                del tensor   # before the next produce(): one tensor alive, not two
            f.flush()
            os.fsync(f.fileno())
            return f.tell()
    except OSError as exc:   # a full disk names no file by itself
        raise CheckpointError(f"cannot write checkpoint file {path}: "
                              f"{exc.strerror or exc}") from exc


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, little-endian, without a copy when it is contiguous on the CPU."""
    flat = tensor.detach().reshape(-1).cpu().contiguous()
    return memoryview(flat.view(torch.uint8).numpy())


def fsync_path(path: str) -> None:
    """Make a file's contents, or a directory's entries (new files, renames), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Reader:
    """Open safetensors files lazily (header only) and read keys or element ranges.

    Every error, from a missing file to a truncated one, is a :class:`CheckpointError`
    naming the file. ``elements_read`` counts the elements handed out, so a load can show
    that it read only the ranges it needed.
    """

    def __init__(self, directory: str,
                 on_open: Optional[Callable[[str, dict], None]] = None) -> None:
        """``on_open(filename, metadata)`` checks each file as it is first opened (the
        checkpoint loader's provenance check) and raises to refuse it."""
        self.directory = directory
        self._on_open = on_open
        self.elements_read = 0
        self.bytes_read = 0
        self._stack = ExitStack()
        self._open: dict[str, object] = {}
        self._keys: dict[str, frozenset[str]] = {}

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    @property
    def files_opened(self) -> int:
        return len(self._open)

    def handle(self, filename: str):
        """The open ``safe_open`` handle of ``filename`` (validates its header)."""
        if filename not in self._open:
            path = os.path.join(self.directory, filename)
            try:   # the one opener: a regular file inside the directory, header bounded
                self._open[filename] = self._stack.enter_context(untrusted.open_safetensors(
                    path, what="checkpoint file", root=self.directory,
                    max_header_bytes=MAX_HEADER_BYTES))
                self._keys[filename] = frozenset(self._open[filename].keys())  # once per file
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint file {path} is missing") from None
            except untrusted.UnsafeFile as exc:
                raise CheckpointError(str(exc)) from None
            except (SafetensorError, OSError, ValueError) as exc:
                raise CheckpointError(f"checkpoint file {path} is corrupted or truncated: "
                                      f"{exc}") from exc
            if self._on_open is not None:
                self._on_open(filename, self._open[filename].metadata() or {})
        return self._open[filename]

    def check(self, filename: str, key: str, dtype: torch.dtype,
              shape: Optional[tuple[int, ...]] = None) -> None:
        """Raise unless ``filename`` holds ``key`` with this dtype (and shape)."""
        handle = self.handle(filename)
        path = os.path.join(self.directory, filename)
        if key not in self._keys[filename]:
            raise CheckpointError(f"checkpoint file {path} has no tensor {key!r}")
        piece = handle.get_slice(key)
        found = piece.get_dtype()
        if found != dtype_name(dtype):
            raise CheckpointError(f"checkpoint file {path}: tensor {key!r} has dtype {found}, "
                                  f"expected {dtype_name(dtype)}")
        if shape is not None and tuple(piece.get_shape()) != tuple(shape):
            raise CheckpointError(f"checkpoint file {path}: tensor {key!r} has shape "
                                  f"{tuple(piece.get_shape())}, expected {tuple(shape)}")

    def read(self, filename: str, key: str) -> torch.Tensor:
        """The whole tensor ``key``."""
        tensor = self._guarded(filename, key, lambda h: h.get_tensor(key))
        self._count(tensor)
        return tensor

    def read_range(self, filename: str, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the 1-D tensor ``key``, reading only those bytes."""
        tensor = self._guarded(filename, key, lambda h: h.get_slice(key)[start:end])
        self._count(tensor)
        return tensor

    def metadata(self, filename: str) -> dict[str, str]:
        return self.handle(filename).metadata() or {}

    def _guarded(self, filename: str, key: str, fn):
        handle = self.handle(filename)
        try:
            return fn(handle)
        except (SafetensorError, OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint file {os.path.join(self.directory, filename)}: "
                                  f"cannot read {key!r}: {exc}") from exc

    def _count(self, tensor: torch.Tensor) -> None:
        self.elements_read += tensor.numel()
        self.bytes_read += tensor.numel() * tensor.element_size()



def specs_of(items: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(key, t.dtype, tuple(t.shape)) for key, t in items]
