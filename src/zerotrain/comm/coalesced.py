"""Gathers launched together: one launch on a device, one by one on the host.

Why a module of its own: the :class:`~zerotrain.comm.communicator.Communicator`'s
``all_gather_into_many`` and DeepSpeed's ``all_gather_coalesced`` (``deepspeed_api.py``)
launch several all-gathers as one unit, and both take the same path through torch's
coalescing manager, with the same fallback, so the choice lives here once.

Note: coalesced gathers
    :meth:`Communicator.all_gather_into_many` runs several all-gathers, each into an output
    of its own (stage 3 gathers every parameter of a unit straight into its place in the
    unit's full buffer). On a device (NCCL) they go out as one launch: torch's
    ``_coalescing_manager`` collects them and hands them to the backend together (one NCCL
    group call). Host tensors are gathered one by one, each asynchronously, in the same
    order: gloo runs a coalesced gather as ATen work (flatten, copy back) on its own worker
    thread, and with torch 2.13 that corrupts the process heap while the training thread
    runs the next unit's forward (measured: a 3-rank stage-3 run of 150 steps of a 6-block
    model aborted with ``malloc(): unaligned tcache chunk`` or ``double free or
    corruption`` in 7 runs of 7; one by one, or coalesced and waited for at once, it ran
    clean). Gloo copies through a buffer of its own either way, so nothing is lost there.
    Where torch has no coalescing manager, or the backend refuses the coalesced call, each
    gather is launched on its own too; the results are the same, only the launch count
    differs. The backend is the same on every rank, so every rank takes the same path and
    the collectives pair up.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

# torch 2.13 renames the tensor all-gather; torch 2.4 only has the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_coalescing_manager: Any = getattr(dist.distributed_c10d, "_coalescing_manager", None)


def coalescable(outputs: Sequence[torch.Tensor]) -> bool:
    """Whether gathers into ``outputs`` may go out as one launch: several, on a device, with
    a torch that has the coalescing manager (Note: coalesced gathers)."""
    return (len(outputs) > 1 and _coalescing_manager is not None
            and outputs[0].device.type != "cpu")


def launch_gathers(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   group: Optional[dist.ProcessGroup], *, coalesce: bool
                   ) -> tuple[_Launches, Optional[Exception]]:
    """All-gather each ``inputs[i]`` into ``outputs[i]``, asynchronously: as one coalesced
    launch when ``coalesce``, else one by one in order. Also returns the error of a backend
    that refused to coalesce (the gathers then went out one by one), or None."""
    refused = None
    if coalesce:
        try:
            with _coalescing_manager(group, None, async_ops=True) as cm:
                for output, input in zip(outputs, inputs):
                    _all_gather(output, input, group=group, async_op=True)
            return _Launches(list(cm.works), 1, inputs), None
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            _drop_coalescing_state(group)
            refused = exc
    # looked up at launch (Note "public launch points" in communicator.py)
    gather = getattr(sys.modules[__package__], "allgather_fn")
    works = [gather(output, input, group=group, async_op=True)
             for output, input in zip(outputs, inputs)]
    return _Launches(works, len(works), inputs), refused


def _drop_coalescing_state(group: Optional[dist.ProcessGroup]) -> None:
    """Forget gathers a failed coalescing manager left collected: torch clears them only
    when the block ends normally, and later calls on the group would be collected too."""
    c10d = dist.distributed_c10d
    pending = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
    if pending is not None:
        pending.pop(group if group is not None else c10d._get_default_group(), None)


class _Launches:
    """Async works launched together; ``wait()`` waits for all of them. Keeps the inputs
    alive until then (a device copy of a host shard has no other owner)."""

    def __init__(self, works: list, count: int, inputs: Sequence[torch.Tensor]) -> None:
        self._works = [w for w in works if w is not None]
        self.count = count
        self._inputs: Optional[Sequence[torch.Tensor]] = inputs

    def wait(self, *args, **kwargs) -> bool:
        for work in self._works:
            work.wait(*args, **kwargs)
        self._inputs = None
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)
