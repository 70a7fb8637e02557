"""The ``Storage`` protocol: where offloaded state lives, as a stage sees it.

Apart from its choice (``storage.py``) so the storages (``host_storage.py``, ``nvme.py``)
annotate with it without importing the module that builds them.

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

from typing import ContextManager, Optional, Protocol

import torch

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
