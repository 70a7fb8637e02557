"""Checks of schedule parameters, each failure a ConfigError at ``scheduler.params.<key>``
(so a schedule built directly reports what a config section would)."""
from __future__ import annotations

import difflib
import math
from typing import Any, Sequence, Union

import torch

from ..errors import ConfigError

LrValue = Union[float, Sequence[float]]
_PATH = "scheduler.params"
WARMUP_TYPES = ("log", "linear")


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
