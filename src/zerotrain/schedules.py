"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
LRRangeTest.

Formulas, defaults and step semantics mirror ``deepspeed/runtime/lr_schedules.py`` so that a
DeepSpeed ``scheduler`` config section and a DeepSpeed scheduler checkpoint behave the same:

* ``last_batch_iteration`` is the index of the batch whose lr sits in the optimizer. The
  engine calls ``step()`` after every applied optimizer step, moving on to the next batch.
* Constructed with ``last_batch_iteration=-1`` (a fresh run), a schedule at once writes its
  "before the first batch" lr into the optimizer (``warmup_min_lr``; 0 for WarmupCosineLR;
  ``cycle_min_lr`` and ``lr_range_test_min_lr`` for OneCycle and LRRangeTest),
  so the first optimizer step runs at the start of the warmup, not at the optimizer's lr.
  Constructed with any other value (a resume), it leaves the optimizer alone.
* ``warmup_num_steps`` is raised to at least 2, because the log warmup divides by log(n).
* The state dict is DeepSpeed's, ``{"last_batch_iteration": n}``; loading it only moves the
  counter, the optimizer's lr comes back with the optimizer's own state dict.

Where DeepSpeed merely logs a warning (an unknown ``warmup_type`` falls back to ``log``), we
raise ConfigError instead: a typo in a schedule should not silently change training.
"""
from __future__ import annotations

import difflib
import math
import warnings
from typing import Any, Optional, Sequence, Union

import torch

from .config import ZeroTrainConfigWarning
from .errors import ConfigError, StateError

LrValue = Union[float, Sequence[float]]
_PATH = "scheduler.params"
WARMUP_TYPES = ("log", "linear")
_BETA2 = 0.99  # what DeepSpeed's OneCycle writes as beta2 whenever it sets the momentum


# --------------------------------------------------------------------------- validation
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{_PATH}.{key}", f"must be an integer, got {value!r}", value=value)
    if value < minimum:
        raise ConfigError(f"{_PATH}.{key}", f"must be >= {minimum}, got {value}", value=value)
    return value


def _check_nonneg(key: str, value: Any) -> float:
    if not _is_number(value) or value < 0:
        raise ConfigError(f"{_PATH}.{key}", f"must be a non-negative number, got {value!r}",
                          value=value)
    return float(value)


def _per_group(key: str, value: Any, n_groups: int) -> list[float]:
    """One float per param group: a scalar is broadcast, a list must match the group count."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ConfigError(f"{_PATH}.{key}", f"expected {n_groups} values (one per param "
                              f"group), got {len(value)}", value=value)
        return [_check_nonneg(key, v) for v in value]
    return [_check_nonneg(key, value)] * n_groups


def _check_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{_PATH}.{key}", f"must be true or false, got {value!r}", value=value)
    return value


def _ordered(low_key: str, low: Any, high_key: str, high: Any,
             n_groups: int) -> tuple[list[float], list[float]]:
    """Per-group lower and upper bounds, each lower one at most its upper one."""
    lows, highs = _per_group(low_key, low, n_groups), _per_group(high_key, high, n_groups)
    for lo, hi in zip(lows, highs):
        if lo > hi:
            raise ConfigError(f"{_PATH}.{low_key}", f"must be <= {high_key} ({hi}), got {lo}",
                              value=low)
    return lows, highs


def _check_warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        close = difflib.get_close_matches(str(value), WARMUP_TYPES, n=1)
        raise ConfigError(f"{_PATH}.warmup_type", f"must be one of {list(WARMUP_TYPES)}, "
                          f"got {value!r}", value=value,
                          suggestion=f"did you mean {close[0]!r}" if close else None)
    return value


def _param_groups(optimizer: Any) -> list[dict]:
    """The groups whose ``lr`` we own; duck-typed so ZeRO wrappers that expose them work."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not groups:
        raise TypeError(f"{type(optimizer).__name__} has no param_groups to schedule")
    return groups


def _as_float(lr: Any) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


# --------------------------------------------------------------------------- schedules
class _Stepped:
    """Shared step/state plumbing; subclasses define ``get_lr`` for ``last_batch_iteration``."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.param_groups = _param_groups(optimizer)
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, -1)
        self._last_lr: Optional[list[float]] = None

    def _start(self) -> None:
        """DeepSpeed's constructor hook: a fresh run writes the pre-first-batch lr at once."""
        if self.last_batch_iteration == -1:
            self._apply(self.get_lr())

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep the tensor (compiled/capturable optimizers)
            else:
                group["lr"] = lr
        self._last_lr = [_as_float(group["lr"]) for group in self.param_groups]

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Move to ``last_batch_iteration`` (default: the next batch) and write its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer."""
        if self._last_lr is None:
            raise StateError("get_last_lr() needs a step() first (the schedule was "
                             "constructed with last_batch_iteration != -1)")
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counter only, as DeepSpeed does; the next ``step()`` writes the lr."""
        self.last_batch_iteration = _check_int(
            "last_batch_iteration", state["last_batch_iteration"], -1)


class _Schedule(_Stepped):
    """The warmup schedules' shared ``warmup_num_steps``/``warmup_type`` handling."""

    def __init__(self, optimizer: Any, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_int("warmup_num_steps", warmup_num_steps, 1)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    def _warmup_fraction(self) -> float:
        """Progress through warmup in [0, 1) for an iteration inside the warmup window."""
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps


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


# --------------------------------------------------------------------------- config entry
SCHEDULERS: dict[str, type] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}

_COMMON = ("warmup_num_steps", "warmup_type", "last_batch_iteration")
_ALLOWED: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr") + _COMMON,
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr") + _COMMON,
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "cos_min_ratio") + _COMMON,
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
                 "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
                 "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom",
                 "decay_mom_rate", "last_batch_iteration"),
    "LRRangeTest": ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase", "last_batch_iteration"),
}
_REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
             "OneCycle": ("cycle_min_lr", "cycle_max_lr")}


def _did_you_mean(word: str, options: Sequence[str]) -> Optional[str]:
    close = difflib.get_close_matches(word, options, n=1)
    return f"did you mean {close[0]!r}" if close else None


def build_scheduler(type_name: str, params: Optional[dict], optimizer: Any) -> _Schedule:
    """Build the schedule a DeepSpeed ``scheduler`` section names, rejecting bad keys up front.

    Value checks (types, ranges, per-group list lengths) live in the constructors, so a
    schedule built directly reports the same ``scheduler.params.<key>`` errors.
    """
    if type_name not in SCHEDULERS:
        raise ConfigError("scheduler.type", f"unknown scheduler {type_name!r}; expected one of "
                          f"{sorted(SCHEDULERS)}", value=type_name,
                          suggestion=_did_you_mean(str(type_name), list(SCHEDULERS)))
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ConfigError(_PATH, f"must be a mapping, got {type(params).__name__}", value=params)
    allowed = _ALLOWED[type_name]
    for key in params:
        if key not in allowed:
            raise ConfigError(f"{_PATH}.{key}", f"unknown parameter for {type_name}",
                              value=params[key], suggestion=_did_you_mean(str(key), allowed))
    for key in _REQUIRED.get(type_name, ()):
        if key not in params:
            raise ConfigError(f"{_PATH}.{key}", f"is required for {type_name}")
    return SCHEDULERS[type_name](optimizer, **params)
