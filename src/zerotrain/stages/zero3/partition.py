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
    unique in the process) and ``ds_status`` (a ``ds_attrs.ZeroParamStatus``, kept current by
    :func:`mark` at every gather and release).

Note: writes through ds_tensor
    Once a stage owns a parameter, its ``ds_tensor`` is a :class:`ChunkTensor`: a view of
    this rank's chunk in its unit's shard, the tensor the unit all-gathers. DeepSpeed's
    tests and some scripts write a rank's chunk through it, three ways:

    * ``ds_tensor.copy_(t)`` (or any in-place operation) writes the shard itself;
    * ``ds_tensor.data.copy_(t)`` too: ``ChunkTensor.data`` is ``detach()``, which shares
      the shard's version counter (a plain ``.data`` has its own), so the write is seen;
    * ``ds_tensor.data = t`` rebinds the view to ``t``, as for any tensor: the setter
      checks ``t`` (the chunk's numel and dtype, or a ``ValueError`` naming the parameter)
      and the unit copies ``t`` into the shard and points ``ds_tensor`` back at its chunk
      before its next gather (``Unit.take_rebinds``, which looks only at units whose
      ``ds_tensor`` had its ``.data`` assigned since), so later writes reach the shard
      again. ``t`` itself is not kept: writes to it after that do not reach the parameter.
      Assigning the attribute itself (``param.ds_tensor = t``) is not seen.

    Each reaches the unit's next gather. The fp32 master takes the written chunk before
    the next optimizer step, checkpoint save or ``eval()`` (``Unit.take_shard_writes``,
    from the stage's ``settle``): where the shard is the master (fp32 training without
    offload) it already holds it; otherwise the elements whose shard value differs from
    the master's rounding are copied into the master, the others keep their fp32 bits.
    So training continues from the written value, as after
    ``GatheredParameters(modifier_rank=...)``. DeepSpeed differs here: a rebinding detaches
    its ``ds_tensor`` from the flat buffers, and its next step points ``ds_tensor`` back
    at them with values from the fp32 master, which never saw the write (16-bit training
    loses in-place writes the same way), so the write is used for one step and then
    silently dropped. Local on purpose: nothing here is a collective, so a rank that
    writes and one that does not stay in step. A persistent unit stays gathered with the
    old values until the step re-gathers it, and with hpZ a secondary copy made since the
    last step keeps serving that unit's gathers until the next step (both as in
    DeepSpeed).
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from .ds_attrs import ZeroParamStatus, ds_param


_ds_ids = itertools.count()   # DeepSpeed numbers partitioned parameters per process too


def mark(params, status: ZeroParamStatus) -> None:
    """Set ``ds_status`` of partitioned ``params`` (giving each a ``ds_id`` once)."""
    for p in params:
        if getattr(p, "ds_id", None) is None:
            p.ds_id = next(_ds_ids)
        p.ds_status = status


# the plain ``.data`` descriptor (its stub types it as the tensor an instance returns)
_DATA: Any = torch._C.TensorBase.data


class ChunkTensor(torch.Tensor):
    """A partitioned parameter's ``ds_tensor`` once a stage owns it: a view of this rank's
    chunk in its unit's shard (Note: writes through ds_tensor). Operations on it return
    plain tensors; ``ds_param_name`` names the parameter in errors."""

    # Any: the stub types this function apart from Tensor's classmethod; torch's own way
    # to keep operations on a subclass from returning the subclass
    __torch_function__: Any = torch._C._disabled_torch_function_impl
    ds_param_name = "<unnamed>"
    ds_on_rebind: Optional[Callable[[], None]] = None   # the unit's: look at me before use

    @property
    def data(self) -> torch.Tensor:
        # detach() shares the version counter, so a write through it is seen
        return torch.Tensor.detach(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        check_chunk(value, numel=self.numel(), dtype=self.dtype, name=self.ds_param_name)
        _DATA.__set__(self, value)
        if self.ds_on_rebind is not None:
            self.ds_on_rebind()


def chunk_view(chunk: torch.Tensor, name: str,
               on_rebind: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """``chunk`` (a view of a unit's shard) as the ``ds_tensor`` of parameter ``name``;
    ``on_rebind`` is called after each assignment to its ``.data``.

    A chunk that is already a tensor subclass (the planner's fake tensors, which torch
    cannot re-wrap as another subclass) is returned as it is: nobody writes through it."""
    if type(chunk) is not torch.Tensor:
        return chunk
    view = chunk.as_subclass(ChunkTensor)
    view.ds_param_name = name
    view.ds_on_rebind = on_rebind
    return view


def check_chunk(value: object, *, numel: int, dtype: torch.dtype, name: str) -> None:
    """Refuse, naming the parameter, a tensor that cannot be this rank's chunk of it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"parameter {name!r}: ds_tensor.data takes a tensor, got "
                        f"{type(value).__name__}")
    if value.numel() != numel or value.dtype != dtype:
        raise ValueError(
            f"parameter {name!r}: ds_tensor is this rank's chunk of {numel} elements of "
            f"{dtype}; got a tensor of shape {tuple(value.shape)} and {value.dtype} (write "
            "a tensor like ds_tensor, e.g. torch.full_like(p.ds_tensor, v))")


def take_rebinding(param: nn.Parameter, own: torch.Tensor, name: str) -> bool:
    """If ``param.ds_tensor`` no longer views ``own`` (its chunk in the unit's shard: its
    ``.data`` was rebound, or the attribute replaced), copy its values into ``own`` and
    make it view ``own`` again; True if it did (Note: writes through ds_tensor)."""
    current = ds_param(param).ds_tensor
    if (isinstance(current, ChunkTensor) and current.device == own.device
            and (own.numel() == 0 or current.data_ptr() == own.data_ptr())
            and current.shape == own.shape and current.stride() == own.stride()):
        return False
    check_chunk(current, numel=own.numel(), dtype=own.dtype, name=name)
    with torch.no_grad():
        own.copy_(current.reshape(own.shape))
    if isinstance(current, ChunkTensor):
        _DATA.__set__(current, own)   # the object scripts hold stays the parameter's
    else:
        ds_param(param).ds_tensor = chunk_view(own, name,
                                               getattr(current, "ds_on_rebind", None))
    return True


def chunk_numel(numel: int, world: int) -> int:
    return math.ceil(numel / world)


def is_partitioned(param: torch.Tensor) -> bool:
    return getattr(param, "ds_tensor", None) is not None


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the full parameter, partitioned or not."""
    return ds_param(param).ds_shape if is_partitioned(param) else param.shape


def full_numel(param: torch.Tensor) -> int:
    return ds_param(param).ds_numel if is_partitioned(param) else param.numel()


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
    ds = ds_param(param)
    ds.ds_shape = param.shape
    ds.ds_numel = param.numel()
    ds.ds_tensor = chunk if chunk is not None else chunk_of(param.data, rank, world)
    param.data = empty_placeholder(param)
    mark([param], ZeroParamStatus.NOT_AVAILABLE)


def fill_full(param: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """The full value from all ranks' chunks stacked as ``(world, chunk)`` (a view if possible)."""
    ds = ds_param(param)
    return chunks.reshape(-1)[: ds.ds_numel].view(ds.ds_shape)
