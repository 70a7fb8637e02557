"""``client_state``: what a training script saves beside the model, without pickle.

DeepSpeed pickles ``client_state``. zerotrain stores it in the manifest as JSON and keeps
what JSON cannot hold in a safetensors file, so a checkpoint still loads without running
code. What scripts put there works: numbers, strings, lists and dicts with string keys;
tensors (returned on the CPU, as DeepSpeed loads them); numpy arrays and scalars; tuples
(so ``random.getstate()``, ``numpy.random.get_state()`` and ``torch.get_rng_state()`` come
back in the form their ``set`` functions accept); ``argparse.Namespace`` (returned as a
Namespace of the same attributes). Anything else raises CheckpointError naming its key.

Note: tagged values
    A value JSON cannot hold is written as an object with the reserved key ``__zerotrain__``
    naming its kind: ``{"__zerotrain__": "tensor", "key": "client/3"}`` (tensor ``client/3``
    of ``client_state.safetensors``; an array adds ``"numpy_dtype"``),
    ``{"__zerotrain__": "tuple", "items": [...]}``, ``{"__zerotrain__": "namespace",
    "vars": {...}}``. A dict of the user's that has that key itself is refused. Numpy dtypes
    safetensors lacks (unsigned 16-64 bit) are stored bit for bit as the signed integer of
    the same width and viewed back on load.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Optional

import torch

from .manifest import CheckpointError, encode_json, file_identity_check, safe_file
from .stfile import DTYPE_NAMES, Reader, specs_of, write_file

FILE = "client_state.safetensors"
TAG = "__zerotrain__"
_SUPPORTED = ("JSON values (dict with str keys, list, str, int, float, bool, None), tuples, "
              "torch tensors, numpy arrays and scalars, and argparse.Namespace")
_SAME_WIDTH_SIGNED = {"uint16": "int16", "uint32": "int32", "uint64": "int64"}


def encode(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """The JSON form of ``value`` and the tensors it refers to (by key)."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(value, "client_state", tensors), tensors


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    def other(item: Any, where: str) -> Any:
        if isinstance(item, tuple):
            return {TAG: "tuple", "items": _encode(list(item), where, tensors)}
        if isinstance(item, argparse.Namespace):
            return {TAG: "namespace", "vars": _encode(vars(item), f"{where}.vars()", tensors)}
        if isinstance(item, torch.Tensor):
            return _store(_plain_tensor(item, where), where, tensors)
        if type(item).__module__ == "numpy":
            return _encode_numpy(item, where, tensors)
        raise CheckpointError(f"{where} is a {type(item).__module__}."
                              f"{type(item).__qualname__}; client_state can hold {_SUPPORTED}. "
                              "Checkpoints never pickle: convert it, or save it yourself")
    return encode_json(value, path, other, reserved_key=TAG)


def _plain_tensor(tensor: torch.Tensor, path: str) -> torch.Tensor:
    if tensor.dtype not in DTYPE_NAMES:
        raise CheckpointError(f"{path} is a tensor of dtype {tensor.dtype}, which safetensors "
                              f"checkpoints cannot hold (supported: "
                              f"{', '.join(str(d) for d in DTYPE_NAMES)})")
    return tensor.detach().to("cpu").contiguous()


def _store(tensor: torch.Tensor, path: str, tensors: dict[str, torch.Tensor],
           **extra: Any) -> dict:
    key = f"client/{len(tensors)}"
    tensors[key] = tensor
    return {TAG: "tensor", "key": key, **extra}


def _encode_numpy(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    import numpy

    if isinstance(value, numpy.generic) and value.dtype.kind in "biuf":
        return _encode(value.item(), path, tensors)
    if not isinstance(value, numpy.ndarray) or value.dtype.kind not in "biuf":
        raise CheckpointError(f"{path} is a numpy {type(value).__name__} of dtype "
                              f"{getattr(value, 'dtype', '?')}; client_state can hold numeric "
                              f"numpy arrays and {_SUPPORTED}")
    array = numpy.ascontiguousarray(value)
    name = array.dtype.name
    if name in _SAME_WIDTH_SIGNED:
        array = array.view(_SAME_WIDTH_SIGNED[name])
    return _store(_plain_tensor(torch.from_numpy(array.copy()), path), path, tensors,
                  numpy_dtype=name)


# --------------------------------------------------------------------------- save / load
def write(directory: str, tensors: dict[str, torch.Tensor], save_id: str) -> int:
    """Write the client-state tensors into ``directory``; the file size in bytes."""
    return write_file(os.path.join(directory, FILE), specs_of(tensors.items()),
                      lambda spec: tensors[spec.key], metadata={"save": save_id})


def load(manifest: dict, tag_dir: str) -> dict:
    """``client_state`` as it was saved (tensors on the CPU); {} when none was saved."""
    saved = manifest.get("client_state") or {}
    name: Optional[str] = manifest.get("client_state_file")
    try:
        if name is None:
            return decode(saved, _no_tensors(tag_dir))
        safe_file(tag_dir, name, what=f"{tag_dir} manifest client_state_file")
        with Reader(tag_dir, on_open=file_identity_check(manifest, tag_dir)) as reader:
            return decode(saved, lambda key: reader.read(name, key))
    except CheckpointError as exc:
        if tag_dir in str(exc):
            raise
        raise CheckpointError(f"checkpoint {tag_dir}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:   # a tagged value missing its fields
        raise CheckpointError(f"checkpoint {tag_dir}: client_state holds a malformed tagged "
                              f"value ({type(exc).__name__}: {exc})") from None


def _no_tensors(tag_dir: str) -> Callable[[str], torch.Tensor]:
    def missing(key: str) -> torch.Tensor:
        raise CheckpointError(f"{tag_dir}: client_state refers to tensor {key!r} but the "
                              "manifest names no client_state_file")
    return missing


def decode(value: Any, read: Callable[[str], torch.Tensor]) -> Any:
    """The inverse of :func:`encode`, reading tensors with ``read(key)``."""
    if isinstance(value, list):
        return [decode(item, read) for item in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {key: decode(item, read) for key, item in value.items()}
    if kind == "tuple":
        return tuple(decode(item, read) for item in value["items"])
    if kind == "namespace":
        return argparse.Namespace(**decode(value["vars"], read))
    if kind == "tensor":
        tensor = read(value["key"])
        if "numpy_dtype" not in value:
            return tensor
        return tensor.numpy().view(value["numpy_dtype"])
    raise CheckpointError(f"client_state holds an unknown tagged value {kind!r}; was it "
                          "written by a newer zerotrain?")
