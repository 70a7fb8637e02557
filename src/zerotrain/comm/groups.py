"""DeepSpeed's ``deepspeed.utils.groups`` names for sequence parallelism.

Accelerate, the Trainer and ALST scripts ask ``groups._get_sequence_parallel_group()``
(and its size and rank) after ``initialize``; DeepSpeed's engine sets ``groups.mpu`` to the
``mpu`` it was given, and every getter reads it, with DeepSpeed's answers:

* with a sequence-parallel mpu (one that has ``initialize_sequence_parallel``, as
  ``parallel_state_sp`` does), the data-parallel group and world size are None (DeepSpeed
  reduces over the sequence-data-parallel group instead), the model-parallel world size 1;
* without one, the data-parallel group is the world, the sequence-parallel world size 1
  and rank 0, and asking for the sequence-parallel group raises ``KeyError``.

``mpu`` is process-wide because DeepSpeed's API is; ``initialize`` sets it.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

mpu: Any = None


def _sequence_mpu() -> bool:
    return mpu is not None and hasattr(mpu, "initialize_sequence_parallel")


def _get_data_parallel_group():
    """The data-parallel group; None under sequence parallelism (as DeepSpeed)."""
    assert dist.is_initialized(), "dist is not initialized"
    if mpu is not None:
        return None if _sequence_mpu() else mpu.get_data_parallel_group()
    return dist.group.WORLD


def _get_data_parallel_world_size():
    """The data-parallel world size; None under sequence parallelism (as DeepSpeed)."""
    assert dist.is_initialized(), "dist is not initialized"
    if mpu is not None:
        return None if _sequence_mpu() else mpu.get_data_parallel_world_size()
    return dist.get_world_size()


def _get_data_parallel_rank() -> int:
    assert dist.is_initialized(), "dist is not initialized"
    return dist.get_rank(group=_get_data_parallel_group())


def _get_model_parallel_world_size() -> int:
    if mpu is None or _sequence_mpu():
        return 1
    return mpu.get_model_parallel_world_size()


def _get_sequence_parallel_world_size() -> int:
    assert dist.is_initialized(), "dist is not initialized"
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        return mpu.get_sequence_parallel_world_size()
    return 1


def _get_sequence_parallel_rank() -> int:
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_rank"):
        return mpu.get_sequence_parallel_rank()
    return 0


def _get_sequence_parallel_group():
    if mpu is None or not hasattr(mpu, "get_sequence_parallel_group"):
        raise KeyError("No sequence parallel group found")
    return mpu.get_sequence_parallel_group()


def _get_sequence_data_parallel_world_size():
    if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_world_size"):
        return mpu.get_sequence_data_parallel_world_size()
    return _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_rank"):
        return mpu.get_sequence_data_parallel_rank()
    return _get_data_parallel_rank()


def _get_sequence_data_parallel_group():
    if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_group"):
        return mpu.get_sequence_data_parallel_group()
    return _get_data_parallel_group()


def _get_broadcast_src_rank() -> int:
    assert dist.is_initialized(), "dist is not initialized"
    return dist.get_global_rank(_get_sequence_data_parallel_group(), 0)
