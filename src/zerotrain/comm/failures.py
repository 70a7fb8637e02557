"""What a collective was, kept until it fails: the named errors of the communicator.

Why a module of its own: building a message costs formatting on every call, so the
communicator keeps what a collective was in a small record and turns it into a
:class:`~zerotrain.errors.CollectiveError` only on failure; that record and the async
handle that carries it are one job apart from launching collectives.

Note: named failures
    A collective that fails or times out (a rank never arrives: only rank 0 saves, a rank
    sleeps past ``comms_timeout``) raises :class:`~zerotrain.errors.CollectiveError` naming
    the operation, its tensor, its label (what zerotrain was doing: ``gradient bucket 3``,
    ``unit block.2``, ``checkpoint save: ...``), the group's size and its timeout, always,
    not only with ``debug``. The cost on the success path is a ``try`` around the launch
    and, for async calls, a small handle around the work whose ``wait()`` has one too; the
    message is built only when something fails. ``debug`` adds a log line per collective
    (which formats a string on every call, so it stays opt-in).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import CollectiveError
from .setup import group_timeout


class _Failure:
    """What a collective was, kept cheaply (no formatting) until it fails or is logged."""

    __slots__ = ("comm", "op", "tensor", "label", "count", "elements")

    def __init__(self, comm: Any, op: str, tensor: Optional[torch.Tensor],
                 label: str, *, count: int = 0) -> None:
        # The tensor is read only when a message is built; an async handle keeping it holds
        # nothing longer than the backend's work it wraps, which holds it too.
        self.comm, self.op, self.tensor, self.label, self.count = comm, op, tensor, label, count
        self.elements: Optional[int] = None   # of ``count`` tensors, where known

    def what(self) -> str:
        """``rank 0: reduce_scatter of (640,) torch.float32 for gradient bucket 3``."""
        tensor = self.tensor
        if self.count:
            size = "" if self.elements is None else f"{self.elements} elements, "
            of = f" of {self.count} tensors ({size}{getattr(tensor, 'dtype', '?')})"
        elif tensor is not None:
            of = f" of {tuple(tensor.shape)} {tensor.dtype}"
        else:
            of = ""
        return (f"rank {self.comm.rank}: {self.op}{of}"
                + (f" for {self.label}" if self.label else ""))

    def error(self, exc: BaseException) -> CollectiveError:
        """The CollectiveError for ``exc``: what failed, over how many ranks, with which
        timeout, and, for a timeout, what it usually means."""
        try:
            timeout = group_timeout(self.comm.group)
        except Exception:  # noqa: BLE001 - a group torch has torn down: say nothing of it
            timeout = None
        waited = "" if timeout is None else f", timeout {timeout.total_seconds():g}s"
        hint = ""
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            hint = (" (a rank of the group did not join this collective in time: every rank "
                    "must make the same collectives in the same order; comms_timeout sets "
                    "how long a rank waits)")
        return CollectiveError(f"{self.what()} failed (group of {self.comm.world_size} ranks"
                               f"{waited}): {exc}{hint}")


class _DescribedWork:
    """An async work handle whose ``wait()`` failure names the collective. What it was is
    kept as given (a ``_Failure``, or the arguments of one) and made into a message only on
    failure: launching costs one small object."""

    __slots__ = ("_work", "_what")

    def __init__(self, work, what: "_Failure | tuple") -> None:
        self._work = work
        self._what = what

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except Exception as exc:
            what = self._what
            raise (what if isinstance(what, _Failure) else _Failure(*what)).error(exc) from exc

    def is_completed(self) -> bool:
        return self._work.is_completed()
