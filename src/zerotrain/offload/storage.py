"""Where offloaded state lives: the choice among the ``Storage`` implementations.

``DeviceStorage`` (no offload) is here; host memory is ``host_storage.py`` and NVMe files
``nvme.py``. ``build_storage``, ``build_param_storage`` and ``place_masters`` read the
offload plan once and pick among them, so no stage branches on the configuration.

(Note "storage questions" in ``storage_protocol.py``: a stage asks its storage, never
which one it holds.)
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from .host_storage import HostStorage
from .nvme import NvmeStorage
from .plan import OffloadPlan
from .storage_protocol import Storage
from .transfers import Transfers


class DeviceStorage:
    """No offload: state is allocated on the training device, where it is used."""

    def __init__(self, device: torch.device, transfers: Optional[Transfers] = None) -> None:
        self.device = torch.device(device)
        self.transfers = transfers or Transfers(self.device)

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def send(self, shard: torch.Tensor, device: torch.device):
        """``shard`` on ``device`` for a collective, and the context to launch it in."""
        return shard.to(device), contextlib.nullcontext()

    def upload(self, master: torch.Tensor, dtype: torch.dtype,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``master`` (kept here, on the device) as ``dtype`` on the device, or into ``out``."""
        return master.to(dtype) if out is None else out.copy_(master)

    def memory_category(self, role: str) -> str:
        return role

    def can_alias(self) -> bool:
        return True

    def steps_on_host(self) -> bool:
        return False

    def finish_sends(self) -> None:
        """Copies from the device are ordered on its stream: nothing to wait for."""

    def fill_from_master(self, out: torch.Tensor, master: torch.Tensor, *,
                         master_storage: Storage) -> None:
        """The master's storage sends it up (in fp32 from the host, cast on the device)."""
        master_storage.upload(master, out.dtype, out=out)

    def close(self) -> None:
        pass


def build_storage(plan: OffloadPlan, rank: int, device: torch.device,
                  transfers: Optional[Transfers] = None) -> Storage:
    """Where fp32 masters and optimizer state live: the device, host memory or NVMe.
    ``transfers`` issues and counts its copies (one per stage, shared by its storages)."""
    if plan.optimizer == "nvme":
        # the slots are few and bounded, so they are always pinned
        return NvmeStorage(plan.nvme_path, rank, slots=plan.buffer_count, pin_memory=True,
                           transfers=transfers)
    if plan.optimizer_offloaded:
        return HostStorage(plan.pin_memory, transfers)
    return DeviceStorage(device, transfers)


def place_masters(plan: OffloadPlan, storage: Storage, device: Storage,
                  records: Sequence[int]) -> list[Storage]:
    """Stage 3: where each unit's fp32 masters live, for units of ``records[u]`` records
    each, in layout order (Note "partial offload" in updater.py). With
    ``offload_optimizer.ratio`` below 1 the first ``plan.records_on_device`` records stay
    on the device, rounded down to whole units (a unit's masters are one tensor), so the
    device never holds more than the ratio leaves it; the other units' masters live in
    ``storage``."""
    if not plan.optimizer_offloaded:
        return [storage] * len(records)
    kept = plan.records_on_device(sum(records))
    out, first = [], 0
    for count in records:
        first += count
        out.append(device if first <= kept else storage)
    return out


def build_param_storage(plan: OffloadPlan, rank: int, device: torch.device,
                        transfers: Optional[Transfers] = None) -> Storage:
    """Where stage-3 parameter shards live between uses: the device, host memory (pinned
    when asked), or files under ``offload_param.nvme_path``, read through the page cache
    when a unit is gathered."""
    if plan.param == "nvme":
        return NvmeStorage(plan.param_nvme_path, rank, section="zero_optimization.offload_param",
                           label="params", transfers=transfers)
    if plan.param_offloaded:
        return HostStorage(plan.param_pin_memory, transfers)
    return DeviceStorage(device, transfers)
