"""Applying a staged load: the copies and assignments both loaders (zerotrain's own format
and DeepSpeed's) make once every rank has read and checked everything (Note "stage,
agree, commit" in ``load.py``). Nothing here can fail on a checked value."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .state import TrainingState


def state_target(live: Any, master: torch.Tensor) -> torch.Tensor:
    """Where a state tensor will live: the live one when it fits (offloaded state stays in
    its host or NVMe storage; written only on commit), else a new one like the master."""
    if (isinstance(live, torch.Tensor) and live.shape == master.shape
            and live.dtype == master.dtype and live.device == master.device):
        return live
    return torch.zeros_like(master)


def commit_tensors(state: TrainingState, tensors: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   states: Sequence[tuple[Any, dict, list]]) -> None:
    """Copy each staged value into its live tensor; give each record its new optimizer
    state (``states``: record, its new state dict, (target, value) copies into it)."""
    with torch.no_grad():
        for target, value in tensors:
            target.copy_(value)
    for record, fresh, copies in states:
        for target, value in copies:
            target.copy_(value)
        live = record.optimizer_state
        live.clear()
        live.update(fresh)
        state.optimizer.state[record.master] = live
