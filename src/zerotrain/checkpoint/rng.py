"""Random-number generator states as tensors and JSON (never pickled).

Each rank stores its own states in its rank file: Python's ``random`` (625 words plus the
cached gaussian), torch's CPU generator, every CUDA device's generator when CUDA is
initialised, and numpy's global generator when numpy is installed. They are restored only
when the world size is unchanged (rank r then resumes rank r's streams); after resharding
there is no rank to inherit them from.
"""
from __future__ import annotations

import json
import random
from typing import Any

import torch

PREFIX = "rng/"


def capture() -> tuple[dict[str, torch.Tensor], str]:
    """This process's generator states: tensors for the rank file and a JSON string of the
    few scalars (for the file's metadata)."""
    version, words, gauss = random.getstate()
    tensors = {f"{PREFIX}python": torch.tensor(words, dtype=torch.int64),
               f"{PREFIX}torch_cpu": torch.get_rng_state()}
    meta: dict[str, Any] = {"python_version": version, "python_gauss_next": gauss}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{PREFIX}cuda/{i}"] = state
        meta["cuda_devices"] = torch.cuda.device_count()
    numpy_random = _numpy_random()
    if numpy_random is not None:
        kind, keys, pos, has_gauss, cached = numpy_random.get_state()
        tensors[f"{PREFIX}numpy"] = torch.from_numpy(keys.astype("int64"))
        meta["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss),
                         "cached_gaussian": float(cached)}
    return tensors, json.dumps(meta)


def restore(tensors: dict[str, torch.Tensor], meta_json: str) -> None:
    """Set this process's generators from what :func:`capture` produced on the same rank."""
    meta = json.loads(meta_json)
    words = tuple(int(w) for w in tensors[f"{PREFIX}python"].tolist())
    random.setstate((meta["python_version"], words, meta["python_gauss_next"]))
    torch.set_rng_state(tensors[f"{PREFIX}torch_cpu"])
    cuda = [tensors[f"{PREFIX}cuda/{i}"] for i in range(meta.get("cuda_devices", 0))]
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
    numpy_random = _numpy_random()
    if numpy_random is not None and "numpy" in meta and f"{PREFIX}numpy" in tensors:
        info = meta["numpy"]
        keys = tensors[f"{PREFIX}numpy"].numpy().astype("uint32")
        numpy_random.set_state((info["kind"], keys, info["pos"], info["has_gauss"],
                                info["cached_gaussian"]))



def check(tensors: dict[str, torch.Tensor], meta_json: Any) -> None:
    """Raise ValueError naming the first entry :func:`restore` could not apply, trying each
    state on a scratch generator so that this process's own generators stay untouched."""
    try:
        meta = json.loads(meta_json)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"its random-generator metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError("its random-generator metadata is not a JSON object")
    for key in (f"{PREFIX}python", f"{PREFIX}torch_cpu"):
        if key not in tensors:
            raise ValueError(f"it has no tensor {key!r}")
    for key in ("python_version", "python_gauss_next"):
        if key not in meta:
            raise ValueError(f"its random-generator metadata has no {key!r}")
    words = tensors[f"{PREFIX}python"]
    gauss = meta["python_gauss_next"]
    if words.dtype != torch.int64 or words.dim() != 1 or not (
            gauss is None or isinstance(gauss, float)):
        raise ValueError(f"{PREFIX}python or python_gauss_next is not Python's random state")
    _try(f"{PREFIX}python", lambda: random.Random().setstate(
        (meta["python_version"], tuple(int(w) for w in words.tolist()), gauss)))
    _try(f"{PREFIX}torch_cpu", lambda: torch.Generator().set_state(tensors[f"{PREFIX}torch_cpu"]))
    devices = meta.get("cuda_devices", 0)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 0 or any(
            f"{PREFIX}cuda/{i}" not in tensors for i in range(devices)):
        raise ValueError(f"cuda_devices is {devices!r} but the CUDA states do not match it")
    numpy_random = _numpy_random()
    if numpy_random is not None and "numpy" in meta and f"{PREFIX}numpy" in tensors:
        info = meta["numpy"]
        if not isinstance(info, dict) or any(k not in info for k in (
                "kind", "pos", "has_gauss", "cached_gaussian")):
            raise ValueError("its numpy random state is incomplete")
        keys = tensors[f"{PREFIX}numpy"]
        _try(f"{PREFIX}numpy", lambda: numpy_random.RandomState().set_state((
            info["kind"], keys.numpy().astype("uint32"), info["pos"], info["has_gauss"],
            info["cached_gaussian"])))


def _try(key: str, apply) -> None:
    try:
        apply()
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise ValueError(f"{key} is not a valid generator state: {exc}") from None


def _numpy_random():
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random
