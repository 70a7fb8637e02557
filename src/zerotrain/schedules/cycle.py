"""DeepSpeed's cycling schedules: LRRangeTest and OneCycle (with momentum cycling)."""
from __future__ import annotations

import math
import warnings
from typing import Any, Optional

from ..config import ZeroTrainConfigWarning
from ..errors import ConfigError
from .base import _Stepped
from .checks import (LrValue, _PATH, _check_bool, _check_int, _check_nonneg, _is_number, _ordered, _per_group)

_BETA2 = 0.99  # what DeepSpeed's OneCycle writes as beta2 whenever it sets the momentum


class LRRangeTest(_Stepped):
    """Raise every group's lr from ``lr_range_test_min_lr`` by ``lr_range_test_step_rate``
    times its base per ``lr_range_test_step_size`` batches, to find the largest usable lr.

    Batch k runs at ``min_lr * (1 + step_rate * (k + 1) / step_size)``, the interval floored
    when ``lr_range_test_staircase`` is set. As in DeepSpeed, batch 0 is already one step
    up; only the first optimizer step (before any ``step()``) runs at ``min_lr``.
    """

    def __init__(self, optimizer: Any, lr_range_test_min_lr: LrValue = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group("lr_range_test_min_lr", lr_range_test_min_lr,
                                 len(self.param_groups))
        self.step_size = _check_int("lr_range_test_step_size", lr_range_test_step_size, 1)
        self.step_rate = _check_nonneg("lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = _check_bool("lr_range_test_staircase", lr_range_test_staircase)
        if self.last_batch_iteration == -1:
            self._apply(list(self.min_lr))

    def _interval(self) -> float:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(interval) if self.staircase else interval

    def get_lr(self) -> list[float]:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


class OneCycle(_Stepped):
    """DeepSpeed's 1Cycle: one cycle up from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` batches and back down over ``cycle_second_step_size``, then a
    decay phase; with ``cycle_momentum``, Adam's beta1 moves the opposite way.

    DeepSpeed's behaviour, kept on purpose so configs and checkpoints carry over:

    * Batch k's position in the cycle is taken at k + 1, like the other schedules.
    * There is one cycle; after ``cycle_first_step_size + cycle_second_step_size`` batches
      the lr is ``cycle_min_lr / (1 + decay_lr_rate * j / decay_step_size)`` at decay batch
      j = 1, 2, ... (continuous, not stepped), or stays ``cycle_min_lr`` when
      ``decay_step_size`` or ``decay_lr_rate`` is 0. beta1 becomes
      ``cycle_max_mom * (1 + decay_mom_rate * j / decay_step_size)``: it *grows* with a
      positive ``decay_mom_rate``.
    * The stair counts are accepted and stored but do not shape the cycle (DeepSpeed never
      reads them); a non-zero one warns.
    * Momentum is written as ``betas = (mom, 0.99)``: beta2 becomes 0.99 whatever the
      optimizer had. A fresh run starts at ``(cycle_min_mom, 0.99)`` although the cycle's
      first batch is at ``cycle_max_mom``. An optimizer without ``betas`` (SGD) warns and
      keeps its momentum.
    """

    def __init__(self, optimizer: Any, cycle_min_lr: LrValue, cycle_max_lr: LrValue,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: LrValue = 0.8,
                 cycle_max_mom: LrValue = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n = len(self.param_groups)
        first = _check_int("cycle_first_step_size", cycle_first_step_size, 1)
        second = first if cycle_second_step_size is None else _check_int(
            "cycle_second_step_size", cycle_second_step_size, 0)
        self.total_size = float(first + second)
        self.step_ratio = first / self.total_size
        self.first_stair_count = _check_int("cycle_first_stair_count", cycle_first_stair_count, 0)
        self.second_stair_count = self.first_stair_count if cycle_second_stair_count is None \
            else _check_int("cycle_second_stair_count", cycle_second_stair_count, 0)
        if self.first_stair_count or self.second_stair_count:
            warnings.warn("scheduler.params.cycle_first_stair_count/cycle_second_stair_count "
                          "have no effect: DeepSpeed's OneCycle accepts them but its cycle is "
                          "continuous, and so is this one", ZeroTrainConfigWarning, stacklevel=2)
        self.decay_step_size = _check_int("decay_step_size", decay_step_size, 0)
        self.min_lrs, self.max_lrs = _ordered("cycle_min_lr", cycle_min_lr, "cycle_max_lr",
                                              cycle_max_lr, n)
        self.decay_lr_rate = _check_nonneg("decay_lr_rate", decay_lr_rate)
        self.cycle_momentum = _check_bool("cycle_momentum", cycle_momentum)
        min_moms, max_moms = _ordered("cycle_min_mom", cycle_min_mom, "cycle_max_mom",
                                      cycle_max_mom, n)
        for key, moms in (("cycle_min_mom", min_moms), ("cycle_max_mom", max_moms)):
            if any(m >= 1 for m in moms):
                raise ConfigError(f"{_PATH}.{key}", f"must be below 1 (it becomes Adam's "
                                  f"beta1), got {moms}", value=moms)
        if not _is_number(decay_mom_rate):
            raise ConfigError(f"{_PATH}.decay_mom_rate", f"must be a finite number, got "
                              f"{decay_mom_rate!r}", value=decay_mom_rate)
        self.decay_mom_rate = float(decay_mom_rate)
        self.min_moms = [(m, _BETA2) for m in min_moms]
        self.max_moms = [(m, _BETA2) for m in max_moms]
        self.skip_lr_decay = self.decay_step_size == 0 or self.decay_lr_rate == 0
        self.skip_mom_decay = self.decay_step_size == 0 or self.decay_mom_rate == 0
        if self.cycle_momentum and not all("betas" in g for g in self.param_groups):
            warnings.warn(f"scheduler.params.cycle_momentum is ignored: "
                          f"{type(optimizer).__name__} has no betas to cycle (as in DeepSpeed)",
                          ZeroTrainConfigWarning, stacklevel=2)
            self.cycle_momentum = False
        if self.last_batch_iteration == -1:
            self._apply(list(self.min_lrs))
            if self.cycle_momentum:
                self._apply_moms(self.min_moms)

    def _scale_factor(self) -> float:
        """Height in the cycle, 0 at ``cycle_min_lr`` and 1 at ``cycle_max_lr``."""
        position = (self.last_batch_iteration + 1) / self.total_size
        x = 1.0 + position - math.floor(1 + position)  # DeepSpeed's rounding, bit for bit
        if x <= self.step_ratio:
            return x / self.step_ratio
        return (x - 1) / (self.step_ratio - 1)

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> Optional[list[tuple[float, float]]]:
        """The ``betas`` for ``last_batch_iteration``; None without ``cycle_momentum``."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi - (hi - lo) * scale, beta2)
                    for (lo, beta2), (hi, _) in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [(hi * factor, beta2) for hi, beta2 in self.max_moms]

    def _apply_moms(self, moms: list[tuple[float, float]]) -> None:
        for group, betas in zip(self.param_groups, moms):
            group["betas"] = betas

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Move to the batch, write its lr and, with ``cycle_momentum``, its betas."""
        super().step(last_batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            self._apply_moms(moms)
