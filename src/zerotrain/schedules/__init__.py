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

from .base import _Schedule, _Stepped
from .build import SCHEDULERS, build_scheduler
from .checks import WARMUP_TYPES, LrValue
from .cycle import LRRangeTest, OneCycle
from .warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

# DeepSpeed's names: Accelerate tests ``type(scheduler).__name__ in VALID_LR_SCHEDULES``
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR = "LRRangeTest", "OneCycle", "WarmupLR"
WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["SCHEDULERS", "WARMUP_TYPES", "LRRangeTest", "LrValue", "OneCycle", "WarmupCosineLR",
           "WarmupDecayLR", "WarmupLR", "build_scheduler", "VALID_LR_SCHEDULES"]
