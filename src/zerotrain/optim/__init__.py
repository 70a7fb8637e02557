"""Optimizers over flat shards (``optimizer.py``: built from the config, or a client's
re-targeted, so the update never sees a full parameter) and DeepSpeed's optimizer wrapper
classes for ``isinstance`` on ``engine.optimizer`` (``kinds.py``)."""
from __future__ import annotations

from .optimizer import (InferenceOnlyOptimizer, ZeroOptimizer, build_optimizer,
                        check_client_optimizer, param_groups_from, retarget_optimizer)

__all__ = ["InferenceOnlyOptimizer", "ZeroOptimizer", "build_optimizer",
           "check_client_optimizer", "param_groups_from", "retarget_optimizer"]
