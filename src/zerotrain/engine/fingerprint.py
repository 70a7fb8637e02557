"""Ranks agree before the first collective: a fingerprint of the model and config.

Why a module of its own: a rank whose model or config differs would otherwise hang in the
first collective whose sizes disagree, or train on silently different data. ``initialize``
exchanges this fingerprint once, before rank 0's weights are broadcast, and every rank
raises the same :class:`~zerotrain.errors.RankMismatchError` naming the first difference
(a dotted config key, a parameter's name and shape).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from torch import nn

from ..comm import Communicator
from ..config import ZeroTrainConfig
from ..errors import RankMismatchError
from ..stages.zero3.partition import full_shape


def fingerprint(model: nn.Module, cfg: ZeroTrainConfig) -> dict:
    """What must be identical on every rank: parameter and buffer names/shapes/dtypes (rank
    0's are broadcast into them) and the config."""
    params = [(n, tuple(full_shape(p)), str(p.dtype), p.requires_grad)
              for n, p in model.named_parameters()]
    buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    digest = hashlib.sha256(json.dumps([params, buffers]).encode()).hexdigest()[:16]
    return {"parameters": digest, "parameter_list": params, "buffer_list": buffers,
            "config": json.dumps(cfg.raw, sort_keys=True, default=str)}


def check_same_across_ranks(comm: Communicator, local: dict) -> None:
    """Raise RankMismatchError on every rank when any rank's fingerprint differs."""
    if comm.world_size == 1:
        return
    everyone = comm.all_gather_object(local)
    reference = everyone[0]
    for rank, other in enumerate(everyone):
        if other["config"] != reference["config"]:
            key = _config_difference(json.loads(reference["config"]),
                                     json.loads(other["config"]))
            raise RankMismatchError(f"rank {rank} has a different config than rank 0: {key}")
        if other["parameters"] != reference["parameters"]:
            raise RankMismatchError(
                f"rank {rank} has a different model than rank 0: "
                f"{_first_difference(reference, other)}")


def _config_difference(a: Any, b: Any, path: str = "") -> str:
    """The first dotted key whose value differs, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            where = f"{path}.{key}" if path else key
            if key not in a or key not in b:
                side = "rank 0" if key in a else "the other rank"
                return f"{where} is set only on {side}"
            if a[key] != b[key]:
                return _config_difference(a[key], b[key], where)
    return f"{path or 'the config'} is {a!r} on rank 0, {b!r} on the other rank"


def _first_difference(reference: dict, other: dict) -> str:
    for kind in ("parameter", "buffer"):
        a, b = reference[f"{kind}_list"], other[f"{kind}_list"]
        for i, (x, y) in enumerate(zip(a, b)):
            if tuple(x) != tuple(y):
                return f"{kind} {i}: rank 0 has {tuple(x)}, the other rank has {tuple(y)}"
        if len(a) != len(b):
            return f"rank 0 has {len(a)} {kind}s, the other rank has {len(b)}"
    return "the fingerprints differ"
