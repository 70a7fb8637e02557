"""A DeepSpeed ``scheduler`` config section to a schedule: the registry, allowed and
required keys, did-you-mean."""
from __future__ import annotations

import difflib
from typing import Any, Optional, Sequence

from ..errors import ConfigError
from .base import _Schedule
from .checks import _PATH
from .cycle import LRRangeTest, OneCycle
from .warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR


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
