"""One parameter's partition: which elements a rank keeps when parameters are sharded.

Note: parameter chunks
    A partitioned parameter of ``numel`` elements keeps, on rank ``r`` of ``world``, the
    elements ``[r * chunk, (r + 1) * chunk)`` of its flattened value, ``chunk =
    ceil(numel / world)``, zero-padded to ``chunk``: the same per-parameter chunk as
    ``flat.FlatLayout``. So ``zero.Init`` can partition each module as it is built, before any
    grouping into units exists, and the stage later assembles unit shards from these chunks.

    While partitioned, ``param.data`` is an empty tensor of the parameter's dtype (touching
    it fails loudly instead of reading stale values) and the DeepSpeed attributes describe the
    full parameter: ``ds_shape``, ``ds_numel``, and ``ds_tensor`` (this rank's chunk; for a
    frozen parameter kept as int8, ``zero3/frozen.py``, its packed bytes, as in DeepSpeed).
    ``param.shape`` is therefore ``(0,)``: read full values inside
    ``zero.GatheredParameters``. Code written for DeepSpeed also finds ``ds_id`` (a number
    unique in the process) and ``ds_status`` (a :class:`ZeroParamStatus`, kept current by
    :func:`mark` at every gather and release).
"""
from __future__ import annotations

import enum
import itertools
import math
from typing import Optional

import torch
from torch import nn


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``ds_status`` values: whether ``param.data`` holds the full value."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_ds_ids = itertools.count()   # DeepSpeed numbers partitioned parameters per process too


def mark(params, status: ZeroParamStatus) -> None:
    """Set ``ds_status`` of partitioned ``params`` (giving each a ``ds_id`` once)."""
    for p in params:
        if getattr(p, "ds_id", None) is None:
            p.ds_id = next(_ds_ids)
        p.ds_status = status


def chunk_numel(numel: int, world: int) -> int:
    return math.ceil(numel / world)


def is_partitioned(param: torch.Tensor) -> bool:
    return getattr(param, "ds_tensor", None) is not None


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the full parameter, partitioned or not."""
    return param.ds_shape if is_partitioned(param) else param.shape


def full_numel(param: torch.Tensor) -> int:
    return param.ds_numel if is_partitioned(param) else param.numel()


def chunk_of(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s zero-padded chunk of ``full`` (a new tensor, same dtype/device)."""
    flat = full.detach().reshape(-1)
    chunk = chunk_numel(flat.numel(), world)
    out = torch.zeros(chunk, dtype=full.dtype, device=full.device)
    start = min(rank * chunk, flat.numel())
    end = min(start + chunk, flat.numel())
    out[: end - start].copy_(flat[start:end])
    return out


def empty_placeholder(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=param.dtype, device=param.device)


def partition(param: nn.Parameter, rank: int, world: int,
              chunk: Optional[torch.Tensor] = None) -> None:
    """Keep only this rank's chunk of ``param`` (``chunk`` if given) and drop the rest."""
    if is_partitioned(param):
        return
    param.ds_shape = param.shape
    param.ds_numel = param.numel()
    param.ds_tensor = chunk if chunk is not None else chunk_of(param.data, rank, world)
    param.data = empty_placeholder(param)
    mark([param], ZeroParamStatus.NOT_AVAILABLE)


def fill_full(param: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """The full value from all ranks' chunks stacked as ``(world, chunk)`` (a view if possible)."""
    return chunks.reshape(-1)[: param.ds_numel].view(param.ds_shape)
