"""The update without offload: one optimizer call over every record on the device."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .gradients import Gradients, as_grad_of


class DeviceUpdater:
    """No offload: one optimizer step over every record on the device, then publish."""

    delayed = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def attach(self, masters: Sequence[torch.Tensor],
               on_device: Optional[Sequence[int]] = None) -> None:
        pass

    def step(self, masters: Sequence[torch.Tensor], grads: Gradients,
             publish: Callable[[int], None], order: Optional[Sequence[int]] = None) -> None:
        for k, master in enumerate(masters):
            master.grad = as_grad_of(master, grads.on_device(k))
        self.optimizer.step()   # one call: fused and foreach kernels see every shard
        for master in masters:
            master.grad = None
        for k in range(len(masters)):
            publish(k)

    def settle(self) -> bool:
        return False

    def stream(self, k: int, shard: torch.Tensor, world: int) -> None:
        """Nothing leaves the device."""

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def forget(self) -> None:
        pass

    def retract(self) -> None:
        pass

    def take_timings(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
