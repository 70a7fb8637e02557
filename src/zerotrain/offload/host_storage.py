"""Offloaded state in host RAM: ``HostStorage``, always resident, pinned when asked.

Apart from the protocol (``storage_protocol.py``) and the choice (``storage.py``) because
pinning is its own job: page-locking memory of its own pages with ``cudaHostRegister`` and unlocking it at close. ``nvme.py``
builds on it (the swap slots are host memory too).
"""
from __future__ import annotations

import logging
import mmap
from typing import Optional, Sequence

import torch

from .traffic import nbytes
from .storage_protocol import Storage
from .transfers import Transfers

logger = logging.getLogger(__name__)


def _pinnable(pin: bool) -> bool:
    return bool(pin) and torch.cuda.is_available()


class HostStorage:
    """State in host RAM, pinned when asked (and CUDA exists): always resident.

    Pinned state is ordinary memory page-locked with ``cudaHostRegister`` rather than taken
    from torch's pinned allocator, which rounds every block up to a power of two: for
    state that is most of the host's memory, that rounding could nearly double it.
    """

    category_prefix = "host_"   # memory_breakdown: host_optimizer_state, host_parameters
    swaps = False

    def __init__(self, pin_memory: bool = False, transfers: Optional[Transfers] = None) -> None:
        self.pin = _pinnable(pin_memory)
        self._registered: list[torch.Tensor] = []
        self.transfers = transfers or Transfers(torch.device("cpu"))

    def send(self, shard: torch.Tensor, device: torch.device):
        """``shard`` (host) on ``device``, copied on the side stream, and the context to
        launch its collective in (Note "copy streams" in transfers.py)."""
        return self.transfers.send(shard, device)

    def upload(self, master: torch.Tensor, dtype: torch.dtype,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``master`` (fp32, kept here) as ``dtype`` on the device: fp32 crosses and the
        device casts (Note "the host does only Adam" in transfers.py)."""
        return self.transfers.upload(master, dtype, out)

    def memory_category(self, role: str) -> str:
        return self.category_prefix + role

    def can_alias(self) -> bool:
        return False

    def steps_on_host(self) -> bool:
        return True

    def finish_sends(self) -> None:
        """Host tensors may still be read by queued host-to-device copies: let them land."""
        self.transfers.synchronize()

    def fill_from_master(self, out: torch.Tensor, master: torch.Tensor, *,
                         master_storage: Storage) -> None:
        """Host to host: parameters on the host need their masters on the host too
        (offload/plan.py); the one 16-bit write per parameter (Note "host traffic")."""
        out.copy_(master)
        self.transfers.host.record("param_fill", read=nbytes(master), written=nbytes(out))

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not self.pin or numel == 0:
            return torch.zeros(numel, dtype=dtype)
        # whole pages of its own: cudaHostRegister refuses a page that is registered already,
        # and two small tensors from the heap may share one
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        span = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        raw = torch.zeros(span + mmap.PAGESIZE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % mmap.PAGESIZE
        pages = raw[start: start + span]
        self._register(pages)
        return pages[:nbytes].view(dtype)

    def _register(self, pages: torch.Tensor) -> None:
        nbytes = pages.numel()
        status = torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), nbytes, 1)  # portable
        if int(status) != 0:
            logger.warning("could not page-lock %.2f GiB of offloaded state (CUDA error %s); "
                           "it stays pageable, and its copies synchronous", nbytes / 2**30,
                           int(status))
            return
        self._registered.append(pages)

    def staging(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A transfer buffer (pinned when possible, so copies can be asynchronous)."""
        return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())

    # the swap protocol, trivially: everything is always in memory
    def prefetch(self, key: int, tensors: Sequence[torch.Tensor]) -> None:
        pass

    def swap_in(self, key: int) -> None:
        pass

    def swap_out(self, key: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def abort(self) -> None:
        """After a failed step: nothing is swapped, nothing to undo."""

    def close(self) -> None:
        """Unlock pinned state (the tensors stay valid, pageable)."""
        if self._registered:
            torch.cuda.synchronize()   # no copy from it may still be in flight
        for tensor in self._registered:
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        self._registered.clear()
