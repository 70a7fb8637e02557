"""``zerotrain.utils``: DeepSpeed's ``deepspeed.utils`` helpers that training scripts call.

``logger`` and ``log_dist`` log as DeepSpeed's do. The ``safe_get_full_*`` /
``safe_set_full_fp32_param`` functions read and write one parameter's full fp32 master,
gradient or optimizer state, whichever stage holds it: each rank's chunk lives in its flat
shard (``flat.py``: rank r owns chunk r of every parameter), so the full value is the
concatenation of every rank's chunk. They are collective when the shards differ between
ranks (stages 1-3): every rank must call them, for the same parameter, in the same order.
They find the engine through the parameter, so call them after ``initialize``.
They are the engine's (``engine/full_params.py``, with the tensor-parallel terms); this
module only gives them DeepSpeed's module path.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from .checkpoint.consolidate import (convert_zero_checkpoint_to_fp32_state_dict,
                                     get_fp32_state_dict_from_zero_checkpoint)
from .comm import get_rank, is_initialized
from .dataloader import RepeatingLoader
from .engine.full_params import (safe_get_full_fp32_param, safe_get_full_grad,
                                 safe_get_full_optimizer_state, safe_get_local_fp32_param,
                                 safe_get_local_grad, safe_get_local_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_grad,
                                 safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                 safe_set_local_grad, safe_set_local_optimizer_state,
                                 safe_update_full_grad_vectorized)
from .errors import StateError
from .offload.states import parse_include
from .core.log import ALL_RANKS
from .stages.zero3.leaf import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                         set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                         unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)

__all__ = ["RepeatingLoader", "convert_zero_checkpoint_to_fp32_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "log_dist", "logger",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param",
           # DeepSpeed's setters, stage 3's local (this rank's chunk) accessors, log level
           "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_update_full_grad_vectorized", "safe_get_local_fp32_param",
           "safe_get_local_grad", "safe_get_local_optimizer_state", "get_state_devices",
           "safe_set_local_fp32_param", "safe_set_local_grad",
           "safe_set_local_optimizer_state", "set_log_level_from_string",
           # stage 3's leaf modules (zero3/leaf.py), DeepSpeed 0.19's names
           "get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]

logger = logging.getLogger("zerotrain")


def log_dist(message: str, ranks: Optional[list[int]] = None,
             level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ``ranks`` (``[-1]``: every rank), prefixed with the
    rank, as DeepSpeed's ``log_dist`` does. Without a process group it always logs; with
    one and ``ranks=None`` it logs nowhere (DeepSpeed's rule)."""
    rank = get_rank() if is_initialized() else -1
    should_log = not is_initialized()
    if ranks and not should_log:
        should_log = ranks[0] == -1 or rank in set(ranks)
    if should_log:
        logger.log(level, "[Rank %d] %s", rank, message, extra={ALL_RANKS: True})


def set_log_level_from_string(log_level_str: str, custom_logger: Any = None) -> None:
    """Set the level of ``custom_logger`` (zerotrain's logger by default) from a name such
    as ``"info"``, as DeepSpeed's ``set_log_level_from_string``."""
    level = logging.getLevelName(str(log_level_str).upper())
    if not isinstance(level, int):
        raise ValueError(f"log level {log_level_str!r} is not one of debug, info, warning, "
                         "error, critical")
    (custom_logger or logger).setLevel(level)


def get_state_devices(model: Any, state: Any) -> set[torch.device]:
    """The devices the engine's ``state`` (an ``OffloadStateTypeEnum`` or its name) is on
    now (DeepSpeed's ``runtime.zero.offload_states.get_state_devices``): where
    ``offload_states`` moved it, or where the config keeps it (optimizer offload puts the
    masters and their state on the host). Empty where the engine holds no such tensor (no
    optimizer state before the first step)."""
    from .engine.engine import ZeroEngine
    kinds = parse_include([state])
    if not isinstance(model, ZeroEngine):
        raise StateError(f"get_state_devices: {type(model).__name__} is not a training "
                         "engine of zerotrain (pass what deepspeed.initialize returned)")
    return {t.device for t in model.stage.movable_states(resident_only=False)[kinds[0]]
            if t is not None}
