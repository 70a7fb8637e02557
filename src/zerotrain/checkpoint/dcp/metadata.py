"""torch Distributed Checkpoint (DCP) ``.metadata``, read without running pickled code.

Note: what a DCP ``.metadata`` may name
    DCP pickles a ``Metadata`` dataclass: per flattened key a ``TensorStorageMetadata`` (shape,
    dtype, chunks) or ``BytesStorageMetadata``; per chunk a ``MetadataIndex`` -> ``_StorageInfo``
    (file, offset, length); ``planner_data`` (flattened key -> its path in the nested state
    dict) and a ``StorageMeta``. The pickle names those classes, ``torch.Size``, dtypes,
    ``pathlib.PosixPath``, ``torch.serialization._get_layout`` and DCP's memory-format enum.
    The classes become inert records (``restricted.InertRecord``), the rest resolve to
    functions that only build values; any other global is refused, naming it and the file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..manifest import CheckpointError, read_regular_file
from ..restricted import inert_classes, restricted_loads

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 1 << 30

_CLASSES = tuple(f"torch.distributed.checkpoint.{name}" for name in (
    "metadata.Metadata", "metadata.TensorStorageMetadata", "metadata.BytesStorageMetadata",
    "metadata.ChunkStorageMetadata", "metadata.TensorProperties", "metadata.MetadataIndex",
    "metadata.StorageMeta", "metadata._MEM_FORMAT_ENCODING", "filesystem._StorageInfo",
    "_extension.StreamTransformExtension"))
_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
           "uint8", "bool")


def _path(*parts: str) -> str:
    """``pathlib`` paths pickle as their parts; only the joined string is kept."""
    if not all(isinstance(p, str) for p in parts):
        raise TypeError("a pathlib path's parts are strings")
    return os.path.join(*parts) if parts else ""


def _layout(name: str) -> str:
    """``torch.serialization._get_layout(name)``: only the layout's name is kept, and it
    must be a string (anything else would be printed: a nested list would never end)."""
    if not isinstance(name, str) or len(name) > 64:
        raise TypeError("a tensor layout is named by a short string")
    return name


ALLOWED: dict[tuple[str, str], Any] = {
    **inert_classes(_CLASSES),
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("torch.serialization", "_get_layout"): _layout,
    ("collections", "OrderedDict"): dict,
    **{("torch", name): getattr(torch, name) for name in _DTYPES},
}


@dataclass(frozen=True, slots=True)
class Chunk:
    """One saved piece of a tensor: where it sits in the full tensor and in which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Entry:
    """One flattened key: a tensor (``shape``, ``dtype``, ``chunks``) or a bytes item."""

    key: str
    path: tuple
    shape: Optional[tuple[int, ...]]
    dtype: Optional[torch.dtype]
    chunks: tuple[Chunk, ...]


def read_metadata(directory: str) -> dict[str, Entry]:
    """Every flattened key of the DCP checkpoint in ``directory``, checked (files inside the
    directory, chunk ranges inside the tensor). Raises CheckpointError naming the problem."""
    path = os.path.join(directory, METADATA_NAME)
    try:
        data = read_regular_file(path, what="torch DCP .metadata", root=directory,
                                 max_bytes=MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {directory} is not a DCP checkpoint") from None
    meta = restricted_loads(data, ALLOWED, path=path, what="torch DCP checkpoint's .metadata")
    try:
        return _entries(meta, directory)
    except CheckpointError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path} is not a DCP Metadata record ({type(exc).__name__}: "
                              f"{exc})") from None


def _entries(meta: Any, directory: str) -> dict[str, Entry]:
    path = os.path.join(directory, METADATA_NAME)
    if getattr(meta, "qualname", "") != _CLASSES[0]:
        raise CheckpointError(f"{path} holds a {type(meta).__name__}, not a DCP Metadata")
    storage: dict[tuple, Any] = {}
    for index, info in dict(meta.storage_data).items():
        fields = index.fields()   # DCP leaves out fields at their default (offset None)
        storage[(fields.get("fqn"), tuple(fields.get("offset") or ()))] = info
    planner = dict(meta.planner_data or {})
    entries: dict[str, Entry] = {}
    for key, md in dict(meta.state_dict_metadata).items():
        if not isinstance(key, str):
            raise CheckpointError(f"{path}: a state-dict key is a {type(key).__name__}")
        route = tuple(planner.get(key, (key,)))
        if md.qualname.endswith("BytesStorageMetadata"):
            info = storage.get((key, ()))
            chunk = () if info is None else (_chunk(info, (), (), directory, key),)
            entries[key] = Entry(key, route, None, None, chunk)
            continue
        shape = tuple(int(s) for s in md.size)
        properties = md.properties   # its state is (dtype, layout, requires_grad, ...)
        saved = properties.state
        dtype = saved[0] if isinstance(saved, tuple) and saved else properties.dtype
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{path}: {key!r} has dtype {dtype!r}")
        chunks = []
        for c in md.chunks:
            offsets, sizes = tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
                raise CheckpointError(f"{path}: a chunk of {key!r} at {offsets} of size "
                                      f"{sizes} lies outside its shape {shape}")
            info = storage.get((key, offsets))
            if info is None:
                raise CheckpointError(f"{path}: the chunk of {key!r} at {offsets} has no "
                                      "storage entry")
            chunks.append(_chunk(info, offsets, sizes, directory, key))
        entries[key] = Entry(key, route, shape, dtype, tuple(chunks))
    return entries


def _chunk(info: Any, offsets: tuple, sizes: tuple, directory: str, key: str) -> Chunk:
    relative = info.fields().get("relative_path")
    if (not isinstance(relative, str) or os.path.isabs(relative) or os.sep in relative
            or relative in ("", ".", "..")):
        raise CheckpointError(f"{directory}: {key!r} is stored in {relative!r}, which is not "
                              "a file name inside the checkpoint directory")
    if info.fields().get("transform_descriptors"):
        raise CheckpointError(f"{directory}: {key!r} is stored with transforms "
                              f"{info.transform_descriptors!r} (compression or "
                              "extensions), which zerotrain does not read")
    offset, length = int(info.fields().get("offset", -1)), int(info.fields().get("length", -1))
    if offset < 0 or length < 0:
        raise CheckpointError(f"{directory}: {key!r} has a negative offset or length")
    return Chunk(offsets, sizes, relative, offset, length)
