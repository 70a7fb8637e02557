"""Sharded, atomic, pickle-free checkpoints that reshard from files alone.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` call :func:`save_checkpoint` and
:func:`load_checkpoint` with a :class:`TrainingState`; the export functions read a
checkpoint directory without any process group. See ``docs/checkpoints.md``.

Modules: ``manifest`` (fields, JSON values, validation), ``stfile`` (safetensors writer and
reader), ``fs`` (tags, ``latest``, atomic publication), ``reshard`` (element-range
arithmetic), ``match`` (model vs checkpoint), ``save``, ``writer`` (asynchronous save),
``staged_load`` (the one load sequence, over a source per format), ``load`` (which format,
and zerotrain's own files as a source), ``rng``, ``consolidate``.
"""
from __future__ import annotations

from .consolidate import (convert_zero_checkpoint_to_fp32_state_dict,
                          get_fp32_state_dict_from_zero_checkpoint, iter_fp32_tensors)
from .load import load_checkpoint
from .manifest import CheckpointError
from .save import save_checkpoint
from .state import CheckpointReport, LoadResult, TrainingState
from .writer import BackgroundWriter

__all__ = [
    "BackgroundWriter", "CheckpointError", "CheckpointReport", "LoadResult", "TrainingState",
    "convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
    "iter_fp32_tensors", "load_checkpoint", "save_checkpoint",
]
