"""The batch-size triangle: train_batch_size = micro batch * accumulation steps * world size.

Resolved before pydantic runs, because any two of the three keys determine the third and
only the reader knows the world size; an inconsistent set names all three.

Note: the world of the triangle
    The world size is every rank, tensor-parallel ones included: with
    ``tensor_parallel.autotp_size`` T on N ranks, ``train_batch_size`` = micro batch *
    accumulation * N, as DeepSpeed 0.19 counts it when no ``mpu`` is given (its
    ``DeepSpeedConfig`` takes ``dist.get_world_size()``; AutoTP training and the
    Hugging Face Trainer, which fills ``"auto"`` as ``world_size * micro * accumulation``,
    both go that way). The T ranks of a tensor-parallel group train on one micro-batch,
    so the samples one optimizer step sees are ``train_batch_size / T``; gradients are
    averaged over the N/T data-parallel ranks (docs/tensor-parallel.md, "The batch").
    Sequence parallelism is counted the other way, as DeepSpeed counts it: with
    ``sequence_parallel_size`` S (or an mpu of S) the world of the triangle is N/S, the
    ranks that draw different samples (docs/sequence-parallel.md).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..errors import ConfigError

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
               "gradient_accumulation_steps")


MAX_BATCH = 2 ** 31 - 1   # a DataLoader batch size is a C int; larger is a typo, not a batch


def _batch_value(data: Dict[str, Any], key: str) -> Optional[int]:
    value = data.get(key)  # null counts as not set, as in DeepSpeed
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(key, f"expected an integer >= 1, got {value!r}", value=value)
    if value is not None and value > MAX_BATCH:
        # str() of a number this long raises (Python's 4300-digit limit): describe it instead
        shown = (f"a number of about {int(value.bit_length() * 0.30103) + 1} digits"
                 if value > 10 ** 30 else str(value))
        raise ConfigError(key, f"expected an integer <= {MAX_BATCH}, got {shown}")
    return value


def _resolve_batch(data: Dict[str, Any], world_size: int) -> None:
    """Fill in the batch-size triangle: train = micro * accumulation * world size."""
    tbs, mbs, gas = (_batch_value(data, key) for key in _BATCH_KEYS)
    given = (tbs, mbs, gas)
    if tbs is None and mbs is None:
        raise ConfigError("train_batch_size", "set train_batch_size or "
                          "train_micro_batch_size_per_gpu (or both); gradient_accumulation_steps "
                          "alone does not determine the batch size")
    if tbs is None:
        gas = gas or 1
        tbs = mbs * gas * world_size
    elif mbs is not None and gas is not None:
        if tbs != mbs * gas * world_size:
            raise _batch_error(given, world_size, f" = {mbs * gas * world_size}")
    else:
        if mbs is None:
            gas = gas or 1
        known = (mbs or gas) * world_size
        if tbs % known:
            raise _batch_error(given, world_size, f", but {tbs} is not a multiple of {known}")
        if mbs is None:
            mbs = tbs // known
        else:
            gas = tbs // known
    data.update(zip(_BATCH_KEYS, (tbs, mbs, gas)))


def _batch_error(given: tuple, world_size: int, detail: str) -> ConfigError:
    shown = ["not set" if value is None else str(value) for value in given]
    return ConfigError("train_batch_size", f"train_batch_size ({shown[0]}) must equal "
                       f"train_micro_batch_size_per_gpu ({shown[1]}) * gradient_accumulation_steps "
                       f"({shown[2]}) * world size ({world_size}){detail}", value=given[0])
