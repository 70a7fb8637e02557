"""DeepSpeed's ``deepspeed.comm`` functions, for scripts that call them directly.

Why a module of its own: scripts written for DeepSpeed do ``import deepspeed.comm as dist``
and call ``dist.get_rank()`` or ``dist.all_reduce(t)``; these functions give them the same
names over the default process group (or ``group``) like their torch.distributed namesakes,
apart from zerotrain's own :class:`~zerotrain.comm.Communicator`, which they do not use
(they are not counted in its ledger). The extra keyword arguments of DeepSpeed's versions
(``prof``, ``log_name``, ``debug``) are accepted and ignored. Every rank of the group must
call a collective, in the same order.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from .communicator import _all_gather, _reduce_scatter

ReduceOp = dist.ReduceOp


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _require_group(name: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"comm.{name}() needs the process group: call "
                           "zerotrain.init_distributed() (deepspeed.init_distributed()) or "
                           "zerotrain.initialize() first")


def get_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    _require_group("get_rank")
    return dist.get_rank(group)


def get_world_size(group: Optional[dist.ProcessGroup] = None) -> int:
    """The number of ranks in ``group`` (default: the world)."""
    _require_group("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """The rank on this node, from ``LOCAL_RANK`` (set by torchrun and ``zerotrain launch``)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Optional[dist.ProcessGroup] = None, group_rank: int = 0) -> int:
    """The world rank of rank ``group_rank`` of ``group``."""
    _require_group("get_global_rank")
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def get_world_group() -> dist.ProcessGroup:
    _require_group("get_world_group")
    return dist.group.WORLD


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of ``ranks`` (every rank of the world must call it)."""
    _require_group("new_group")
    return dist.new_group(ranks)


def get_backend(group: Optional[dist.ProcessGroup] = None) -> str:
    _require_group("get_backend")
    return dist.get_backend(group)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def barrier(group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
            device_ids: Any = None, **_: Any):
    """Wait until every rank of ``group`` reaches this call."""
    _require_group("barrier")
    return dist.barrier(group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM,
               group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **_: Any):
    """Reduce ``tensor`` in place over the ranks of ``group`` (``op``: a ``ReduceOp``)."""
    _require_group("all_reduce")
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Optional[dist.ProcessGroup] = None,
              async_op: bool = False, **_: Any):
    """Overwrite ``tensor`` on every rank with world rank ``src``'s."""
    _require_group("broadcast")
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM,
           group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **_: Any):
    """Reduce ``tensor`` into world rank ``dst``'s copy."""
    _require_group("reduce")
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
               group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **_: Any):
    """Every rank's ``tensor`` into ``tensor_list``, in rank order (equal sizes on gloo)."""
    _require_group("all_gather")
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
                           **_: Any):
    """Every rank's ``input_tensor`` concatenated into ``output_tensor`` in rank order."""
    _require_group("all_gather_into_tensor")
    return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                          op: Any = ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None,
                          async_op: bool = False, **_: Any):
    """Sum ``input_tensor`` over ranks; rank r keeps slice r in ``output_tensor``."""
    _require_group("reduce_scatter_tensor")
    if op != ReduceOp.SUM:
        raise ValueError(f"comm.reduce_scatter_tensor supports op=ReduceOp.SUM, got {op}")
    return _reduce_scatter(output_tensor, input_tensor, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor,
                      output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None,
                      group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
                      **_: Any):
    _require_group("all_to_all_single")
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)


def destroy_process_group(group: Optional[dist.ProcessGroup] = None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)
