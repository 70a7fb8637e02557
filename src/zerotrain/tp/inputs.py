"""The first forward checks that the ranks of each tensor-parallel group were given the
same inputs, as DeepSpeed's AutoTP training does (``check_dataloader_inputs_same_across_ranks``,
a forward pre-hook on the model that removes itself after one call).

Note: one batch per group
    The split layers of a group sum partial results that each rank computed on its own
    inputs. Different inputs on two ranks of a group give a sum of unrelated halves, and
    training goes on with no error on what is noise (docs/tensor-parallel.md, "The
    batch"). DeepSpeed broadcasts the first forward's arguments from the group's first
    rank, compares them on every other rank (tensors with ``torch.equal``, other values
    with ``!=``, Hugging Face caches by type only) and fails the group with an assertion.
    Here each rank sends a digest of every value the call was given instead of the tensors
    themselves, followed into nested dicts (and other mappings: a Hugging Face
    ``BatchEncoding``), lists, tuples and dataclasses, positional and keyword arguments
    alike: a SHA-256 of each tensor's (or NumPy array's) bytes with its dtype and shape,
    the value of a number, bool or None, a string itself or, when long, its SHA-256, the
    type and length of each container, the type of anything else (a cache object). A
    batch passed as ``model(batch)`` or ``model(**batch)`` is checked to its last tensor.
    One ``all_gather_object`` over the group gives every rank every digest, so all ranks
    of a group raise together, and the error names the ranks whose inputs differ from the
    first rank's, and where (``args[0]['input_ids']``). Cost: one hash pass over the
    first batch's bytes and one small gather, once; past ``_MAX_ENTRIES`` values the rest
    are folded into one digest.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..errors import ZeroTrainError

_NUMBERS = (bool, int, float, complex, type(None))
_MAX_ENTRIES = 256   # digests sent per rank; the rest are folded into one
_MAX_DEPTH = 32      # containers followed this deep (deeper: by type)
_SHORT = 64          # strings up to this long are sent as they are


class TensorParallelInputError(ZeroTrainError, ValueError):
    """The ranks of one tensor-parallel group were given different inputs."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _tensor_digest(value: torch.Tensor) -> str:
    head = f"tensor {str(value.dtype).replace('torch.', '')} {tuple(value.shape)}"
    if value.device.type == "meta" or value.layout != torch.strided:
        return f"{head} on {value.device.type}, {value.layout}"
    data = value.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return f"{head} sha256 {_sha(data.numpy().tobytes())}"


def _leaf(value: Any) -> Optional[str]:
    """The digest of a value that is not a container; None for a container."""
    if isinstance(value, torch.Tensor):
        return _tensor_digest(value)
    if isinstance(value, _NUMBERS):
        return repr(value)
    if isinstance(value, (str, bytes)):
        if len(value) <= _SHORT:
            return repr(value)
        data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
        return f"{type(value).__name__} of {len(value)} sha256 {_sha(data)}"
    if type(value).__module__ == "numpy" and hasattr(value, "tobytes"):
        return (f"numpy {getattr(value, 'dtype', '')} {getattr(value, 'shape', ())} sha256 "
                f"{_sha(value.tobytes())}")
    if isinstance(value, (Mapping, list, tuple)) or (is_dataclass(value)
                                                     and not isinstance(value, type)):
        return None
    return f"a {type(value).__name__}"   # a cache, a config: by type, as DeepSpeed does


def _walk(value: Any, path: str, out: dict[str, str], depth: int, inside: set) -> None:
    digest = _leaf(value)
    if digest is not None:
        out[path] = digest
        return
    kind = type(value).__name__
    if depth >= _MAX_DEPTH or id(value) in inside:
        out[path] = f"a {kind} (not followed)"
        return
    inside.add(id(value))
    if isinstance(value, Mapping):
        items = sorted(((repr(k), v) for k, v in value.items()), key=lambda kv: kv[0])
        children = [(f"{path}[{k}]", v) for k, v in items]
    elif isinstance(value, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:   # a dataclass instance
        children = [(f"{path}.{f.name}", getattr(value, f.name, None)) for f in fields(value)]
    out[path] = f"a {kind} of {len(children)}"
    for child_path, child in children:
        _walk(child, child_path, out, depth + 1, inside)
    inside.discard(id(value))


def input_digests(args: tuple, kwargs: dict) -> dict[str, str]:
    """``{path: digest}`` of every value of one call: ``args[i]`` and keyword names, and
    below them the values inside containers (``args[0]['input_ids']``, ``batch.mask``), in
    a fixed order; past ``_MAX_ENTRIES`` the rest are one digest (Note "one batch per
    group")."""
    out: dict[str, str] = {}
    for i, value in enumerate(args):
        _walk(value, f"args[{i}]", out, 0, set())
    for name in sorted(kwargs):
        _walk(kwargs[name], name, out, 0, set())
    if len(out) <= _MAX_ENTRIES:
        return out
    kept = list(out.items())[:_MAX_ENTRIES - 1]
    rest = list(out.items())[_MAX_ENTRIES - 1:]
    folded = _sha("".join(f"{k}={v};" for k, v in rest).encode())
    return dict(kept + [(f"{rest[0][0]} and {len(rest) - 1} values after it", folded)])


def check_same_inputs(tp: Communicator, args: tuple, kwargs: dict) -> None:
    """Raise TensorParallelInputError on every rank of ``tp`` when its ranks' ``args`` and
    ``kwargs`` differ (Note "one batch per group"). Collective over ``tp``; a traced world
    (the planner's fake tensors, Note "a traced world" in ``comm/communicator.py``) has no
    data to digest and nobody to disagree with, so it checks nothing."""
    if not getattr(tp, "carries_data", True):
        return
    everyone = tp.all_gather_object(input_digests(args, kwargs),
                                    label="tensor-parallel input check")
    first = everyone[0]
    differ = {}
    for tp_rank, digests in enumerate(everyone[1:], start=1):
        names = list(first) + [n for n in digests if n not in first]
        wrong = [n for n in names if first.get(n) != digests.get(n)]
        if wrong:
            differ[tp.ranks[tp_rank]] = wrong[0]
    if differ:
        ranks = ", ".join(f"rank {r} ({name})" for r, name in sorted(differ.items()))
        raise TensorParallelInputError(
            f"the tensor-parallel group of ranks {list(tp.ranks)} was given different "
            f"inputs on its first forward: {ranks} differ from rank {tp.ranks[0]}. The ranks of a group must see the same "
            "batch; shard the data by engine.get_data_parallel_rank() and "
            "engine.dp_world_size (docs/tensor-parallel.md, \"The batch\")")


def check_first_inputs(model: nn.Module, tp: Communicator) -> None:
    """Register the one-call check on ``model``'s forward (prepended, so it sees the
    caller's arguments); it removes itself after the first forward."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        handle.remove()
        check_same_inputs(tp, args, kwargs)

    handle = model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
