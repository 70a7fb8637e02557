"""DeepSpeed's warmup schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR."""
from __future__ import annotations

import math
from typing import Any, Optional

from .base import _Schedule
from .checks import LrValue, _as_float, _check_int, _check_nonneg, _per_group


class WarmupLR(_Schedule):
    """Warm each group from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    ``warmup_max_lr`` defaults to the first param group's current lr, as in DeepSpeed.
    Either lr may be a list with one value per param group.
    """

    def __init__(self, optimizer: Any, warmup_min_lr: LrValue = 0.0,
                 warmup_max_lr: Optional[LrValue] = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = _as_float(self.param_groups[0]["lr"])
        n = len(self.param_groups)
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, n)
        self.max_lrs = _per_group("warmup_max_lr", warmup_max_lr, n)
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self._start()

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches ``warmup_min_lr`` at ``total_num_steps``.

    Unlike WarmupLR, ``warmup_max_lr`` defaults to 0.001 (DeepSpeed's default here).
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: LrValue = 0.0,
                 warmup_max_lr: LrValue = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, 0)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                         warmup_type, last_batch_iteration)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Scale each group's own lr: warm up from ``warmup_min_ratio`` to 1, then cosine-decay
    to ``cos_min_ratio`` at ``total_num_steps`` and stay there.

    The base lrs are the optimizer's lrs at construction, so build this before loading an
    optimizer checkpoint (whose lrs are already scaled).
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, 0)
        self.warmup_min_ratio = _check_nonneg("warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = _check_nonneg("cos_min_ratio", cos_min_ratio)
        self.org_lrs = [_as_float(group["lr"]) for group in self.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction() * (1.0 - self.warmup_min_ratio)
        # The first post-warmup batch is already one step into the cosine.
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]
