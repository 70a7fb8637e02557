"""Load a DeepSpeed-style JSON config into typed, validated zerotrain settings.

The models mirror DeepSpeed's JSON keys and defaults, so an existing ``ds_config.json`` loads
unchanged; ``load_config`` is the entry point (``load_activation_checkpointing`` reads that one
section alone) and the only exception they raise for bad input is ``ConfigError``, carrying the
dotted key, the bad value and the likely fix.

The schema and the reading are kept apart, so a section can be read without the machinery
and the machinery changed without touching a section:

* schema: ``fields`` (the strict base and shared field types), ``zero`` (ZeRO and offload),
  ``sections`` (precision, optimizer, scheduler, checkpoint, activation checkpointing,
  compile), ``schema`` (``ZeroTrainConfig``, the whole file);
* DeepSpeed's other keys: ``keys`` (accepted-but-unimplemented keys, aliases; Note "why
  unknown keys error but DeepSpeed-only keys warn");
* reading: ``source`` (dict or JSON file), ``walk`` (key checks, did-you-mean, pydantic
  errors at the dotted key), ``batch`` (the batch-size triangle), ``checks`` (key
  combinations), ``reader`` (the entry points, in order).
"""
from __future__ import annotations

# Every public name of the former single module stays importable from here; __all__ is
# unchanged (read_config_dict, unimplemented_message and the constants were never in it).
from .batch import MAX_BATCH
from .fields import Count, NonNegative, PrecisionName, Size
from .keys import UNIMPLEMENTED_KEYS, ZeroTrainConfigWarning, unimplemented_message
from .reader import load_activation_checkpointing, load_config, read_config_dict
from .schema import ZeroTrainConfig
from .sections import (OPTIMIZER_PARAMS, SCHEDULER_TYPES, TORCH_COMPILE_KWARGS,
                       ActivationCheckpointingConfig, AdamParams, BF16Config, CheckpointConfig,
                       CompileConfig, DataTypesConfig, FP16Config, OptimizerConfig, SGDParams,
                       SchedulerConfig)
from .source import MAX_DEPTH
from .zero import OffloadConfig, ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig", "AdamParams", "BF16Config", "CheckpointConfig",
    "CompileConfig",
    "DataTypesConfig", "FP16Config", "OPTIMIZER_PARAMS", "OffloadConfig", "OptimizerConfig",
    "SGDParams", "SchedulerConfig", "UNIMPLEMENTED_KEYS", "ZeroConfig", "ZeroTrainConfig",
    "ZeroTrainConfigWarning", "load_activation_checkpointing", "load_config",
]
