"""Where offloaded state lives, as a stage sees it: the ``Storage`` protocol and its choice.

``DeviceStorage`` (no offload) is here; host memory is ``host_storage.py`` and NVMe files
``nvme.py``. ``build_storage``, ``build_param_storage`` and ``place_masters`` read the
offload plan once and pick among them, so no stage branches on the configuration.

Note: storage questions
    A stage never asks which storage it holds. What differs between the device, host memory
    and NVMe is a method of the :class:`Storage` protocol: where its tensors are counted
    (``memory_category``), whether training tensors may alias them (``can_alias``), whether
    the optimizer over them steps on the host (``steps_on_host``, which also picks the
    updater and the optimizer's device), how a parameter-dtype shard kept here follows its
    master (``fill_from_master``), and what to wait for before rewriting them
    (``finish_sends``).
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Optional, Protocol, Sequence

import torch

from .host_storage import HostStorage
from .nvme import NvmeStorage
from .plan import OffloadPlan
from .transfers import Transfers


class Storage(Protocol):
    """Where a stage's fp32 masters (or stage 3's parameter shards) live, and what follows
    from that. Stages ask it rather than inspect it (Note "storage questions")."""

    transfers: Transfers

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new tensor of ``numel`` elements of ``dtype``, allocated here."""

    def send(self, shard: torch.Tensor, device: torch.device
             ) -> tuple[torch.Tensor, ContextManager]:
        """``shard`` (kept here) on ``device`` for a collective, and the context to launch
        it in."""

    def upload(self, master: torch.Tensor, dtype: torch.dtype,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``master`` (kept here) as ``dtype`` on the device, or written into ``out``."""

    def memory_category(self, role: str) -> str:
        """The ``memory_breakdown`` category of ``role``'s tensors kept here (``"parameters"``
        is ``"host_parameters"`` in host memory)."""

    def can_alias(self) -> bool:
        """Whether training tensors (parameters, parameter-dtype shards) may be views of the
        tensors kept here instead of copies: only when those live on the training device."""

    def steps_on_host(self) -> bool:
        """Whether the optimizer over the tensors kept here runs on the host, one record at
        a time (offload/updater.py), rather than on the device in one call."""

    def finish_sends(self) -> None:
        """Wait for copies still reading the tensors kept here (sent up for the last
        backward), before those tensors are rewritten."""

    def fill_from_master(self, out: torch.Tensor, master: torch.Tensor, *,
                         master_storage: "Storage") -> None:
        """Write ``master``'s values (fp32, kept in ``master_storage``) into ``out``, a
        parameter-dtype shard kept here."""

    def close(self) -> None:
        """Release what the storage holds beyond its tensors (pins, files, threads)."""


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
