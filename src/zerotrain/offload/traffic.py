"""The host-traffic ledger: bytes of host memory each phase of an offloaded step reads and
writes.

Note: host traffic
    At the bound the host's memory bandwidth is what an offloaded step spends, so every pass
    over host memory the code makes is counted here, by phase, beside the copy ledger
    (which counts PCIe bytes). A copy the device issues into or out of host memory (DMA)
    counts as host memory written (``gradient_land``) or read (``upload``); a pass the
    host's cores make counts what it reads and writes. The phases:

    ``gradient_land``   a record's finished fp32 gradient written by the device-to-host copy
    ``adam``            the optimizer's own pass: gradient, master and moments read, master
                        and moments written (as torch's fused Adam touches them)
    ``upload``          the fp32 master read by the host-to-device copy (cast on the device)
    ``upload_staging``  a pageable master copied into a pinned slot first (``pin_memory``
                        false): a pass a pinned master does not need
    ``keep``            the speculative step's copy of a record's state before stepping it
    ``restore``         that copy written back when the speculation did not hold
    ``param_fill``      stage 3 with ``offload_param``: the parameter-dtype host shard cast
                        from its master (the one 16-bit write per parameter)
    ``send_staging``    such a shard in pageable memory copied into a pinned slot before it
                        goes up for its all-gather (``offload_param.pin_memory`` false)

    Nothing else touches host memory per step: the widening, averaging and unscaling of the
    gradient happen on the device before it comes down (``gradients.py``), and the cast to
    the parameter dtype happens on the device after the master goes up (``transfers.py``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

PHASES = ("gradient_land", "adam", "upload", "upload_staging", "keep", "restore",
          "param_fill", "send_staging")


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class HostTraffic:
    """Bytes of host memory read and written, by phase (Note: host traffic)."""

    read: Counter = field(default_factory=Counter)
    written: Counter = field(default_factory=Counter)

    def record(self, phase: str, *, read: int = 0, written: int = 0) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown host-traffic phase {phase!r}; one of {PHASES}")
        self.read[phase] += read
        self.written[phase] += written

    def reset(self) -> None:
        self.read.clear()
        self.written.clear()

    def snapshot(self) -> dict:
        """``{phase: {"read": bytes, "written": bytes}}`` for the phases seen."""
        phases = [p for p in PHASES if self.read[p] or self.written[p]]
        return {p: {"read": self.read[p], "written": self.written[p]} for p in phases}

    def total(self) -> int:
        return sum(self.read.values()) + sum(self.written.values())
