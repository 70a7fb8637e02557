"""DeepSpeed's ``deepspeed.comm`` functions, for scripts that call them directly.

Why a module of its own: scripts written for DeepSpeed do ``import deepspeed.comm as dist``
and call ``dist.get_rank()`` or ``dist.all_reduce(t)``; these functions give them the same
names over the default process group (or ``group``) like their torch.distributed namesakes.
They do not use zerotrain's own :class:`~zerotrain.comm.Communicator` (a script's calls are
not counted in its ledger); the Communicator launches through them instead, so a wrapper
set on one sees zerotrain's collectives too (Note "public launch points" in
``communicator.py``). The extra keyword arguments of DeepSpeed's versions
(``prof``, ``log_name``, ``debug``) are accepted and ignored. Every rank of the group must
call a collective, in the same order; point-to-point calls (``send``/``recv``...) pair one
sender with one receiver. ``isend``/``irecv`` return torch's work handle (DeepSpeed's own
versions block and return None): ``wait()`` on it before reading or reusing the tensor.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import coalesced as _gathers
from . import communicator as _wire
from .coalesced import coalescable, launch_gathers

ReduceOp = dist.ReduceOp


def is_available() -> bool:
    """Whether torch.distributed (and so this package) can be used in this build of torch."""
    return dist.is_available()


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


def get_all_ranks_from_group(group: Optional[dist.ProcessGroup] = None) -> list[int]:
    """The world ranks of ``group``'s members, in group-rank order (default: the world); empty
    on a rank outside ``group``, as in DeepSpeed."""
    _require_group("get_all_ranks_from_group")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return []
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def get_world_group() -> Optional[dist.ProcessGroup]:
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


def has_all_reduce_coalesced() -> bool:
    return hasattr(dist, "all_reduce_coalesced")


def has_coalescing_manager() -> bool:
    return getattr(dist.distributed_c10d, "_coalescing_manager", None) is not None


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
    return _gathers._all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                          op: Any = ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None,
                          async_op: bool = False, **_: Any):
    """Sum ``input_tensor`` over ranks; rank r keeps slice r in ``output_tensor``."""
    _require_group("reduce_scatter_tensor")
    if op != ReduceOp.SUM:
        raise ValueError(f"comm.reduce_scatter_tensor supports op=ReduceOp.SUM, got {op}")
    return _wire._reduce_scatter(output_tensor, input_tensor, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor,
                      output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None,
                      group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
                      **_: Any):
    _require_group("all_to_all_single")
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **_: Any):
    """Sum ``input_list[r]`` over ranks into rank r's ``output`` (one tensor per rank)."""
    _require_group("reduce_scatter")
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
                      **_: Any):
    """DeepSpeed's name for :func:`reduce_scatter_tensor` (which torch always has here)."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **_: Any):
    """DeepSpeed's name for :func:`all_gather_into_tensor` (which torch always has here)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **_: Any):
    """``input_tensor_list[j]`` goes to rank j, which stores it as its ``output_tensor_list[r]``."""
    _require_group("all_to_all")
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group,
                           async_op=async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = ReduceOp.SUM,
                         group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
                         **_: Any):
    """Reduce every tensor of ``tensors`` in place, as one launch where the backend can."""
    _require_group("all_reduce_coalesced")
    return dist.all_reduce_coalesced(tensors, op=op, group=group, async_op=async_op)


def all_gather_coalesced(output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                         group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
    """Every rank's ``input_tensors[i]`` concatenated in rank order into ``output_tensors[i]``,
    launched together (one coalesced launch on a device where torch has a coalescing
    manager; host tensors one by one, Note "coalesced gathers" in ``coalesced.py``)."""
    _require_group("all_gather_coalesced")
    if len(output_tensors) != len(input_tensors):
        raise ValueError(f"comm.all_gather_coalesced got {len(output_tensors)} outputs for "
                         f"{len(input_tensors)} inputs")
    launches, _ = launch_gathers(output_tensors, input_tensors, group,
                                 coalesce=coalescable(output_tensors))
    if async_op:
        return launches
    launches.wait()
    return None


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                         group: Optional[dist.ProcessGroup] = None, **_: Any):
    """DeepSpeed's all-reduce for inference kernels: a plain :func:`all_reduce` here."""
    return all_reduce(tensor, op=op, group=group)


def gather(tensor: torch.Tensor, gather_list: Optional[list[torch.Tensor]] = None, dst: int = 0,
           group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **_: Any):
    """Every rank's ``tensor`` into world rank ``dst``'s ``gather_list`` (None elsewhere)."""
    _require_group("gather")
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: Optional[list[torch.Tensor]] = None,
            src: int = 0, group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
            **_: Any):
    """``scatter_list[r]`` of world rank ``src`` into rank r's ``tensor``."""
    _require_group("scatter")
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group,
                        async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Optional[dist.ProcessGroup] = None,
         tag: int = 0, **_: Any) -> None:
    """Send ``tensor`` to world rank ``dst``, which must :func:`recv` it; blocks until sent."""
    _require_group("send")
    return dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None,
         group: Optional[dist.ProcessGroup] = None, tag: int = 0, **_: Any) -> int:
    """Receive into ``tensor`` from world rank ``src`` (None: any); returns the sender."""
    _require_group("recv")
    return dist.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Optional[dist.ProcessGroup] = None,
          tag: int = 0, **_: Any):
    """:func:`send` without blocking: returns a work handle to ``wait()`` on."""
    _require_group("isend")
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: Optional[int] = None,
          group: Optional[dist.ProcessGroup] = None, tag: int = 0, **_: Any):
    """:func:`recv` without blocking: returns a work handle to ``wait()`` on."""
    _require_group("irecv")
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def monitored_barrier(group: Optional[dist.ProcessGroup] = None,
                      timeout: Optional[timedelta] = None, wait_all_ranks: bool = False,
                      **_: Any) -> None:
    """A barrier that, on gloo, raises on rank 0 naming the ranks that did not arrive within
    ``timeout`` (default: the group's timeout); ``wait_all_ranks`` names all of them."""
    _require_group("monitored_barrier")
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_gather_object(object_list: list, obj: Any,
                      group: Optional[dist.ProcessGroup] = None) -> None:
    """Every rank's picklable ``obj`` into ``object_list`` (``world`` long), in rank order."""
    _require_group("all_gather_object")
    return dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list, src: int,
                          group: Optional[dist.ProcessGroup] = None,
                          device: Optional[torch.device] = None) -> None:
    """Overwrite ``object_list`` on every rank with world rank ``src``'s picklable objects."""
    _require_group("broadcast_object_list")
    return dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def destroy_process_group(group: Optional[dist.ProcessGroup] = None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)
