"""Checks that involve more than one key, made once each key is valid on its own.

Pydantic validates one field at a time; what two keys mean together (fp16 and bf16, ZeRO++
sizes and the world size) is checked here, after the whole file has been validated.
"""
from __future__ import annotations

import warnings

from ..errors import AssertedConfigError, ConfigError
from .keys import ZeroTrainConfigWarning
from .precision_checks import check_bf16_masters, check_torch_autocast
from .schema import ZeroTrainConfig
from .sections import TORCH_COMPILE_KWARGS
from .walk import _unknown_key, _Walk
from .zero import ZeroConfig


def _check_combinations(result: ZeroTrainConfig, walk: _Walk) -> None:
    """Checks that involve two keys, made once each key is valid on its own."""
    if result.fp16.enabled and result.bf16.enabled:
        bf16 = walk.user_path("bf16.enabled")
        raise ConfigError("fp16.enabled", f"fp16.enabled and {bf16} are both true; "
                                          "enable at most one of them", value=True)
    _check_allreduce_op(result.gradient_allreduce_op)
    _check_loss_scale_floor(result)
    _check_allgather_alignment(result, walk)
    for key in result.compile.kwargs:
        if key not in TORCH_COMPILE_KWARGS:
            raise _unknown_key(key, walk.user_path(f"compile.kwargs.{key}"),
                               list(TORCH_COMPILE_KWARGS), [])
    _check_unmanaged_accumulation(result)
    check_bf16_masters(result)
    check_torch_autocast(result)
    for name in ("offload_optimizer", "offload_param"):
        offload = getattr(result.zero_optimization, name)
        if offload is not None and offload.device == "nvme" and not offload.nvme_path:
            raise ConfigError(f"zero_optimization.{name}.nvme_path",
                              'is required when device is "nvme"')


def _check_loss_scale_floor(result: ZeroTrainConfig) -> None:
    """A dynamic scale's ``min_loss_scale`` above its start, ``2**initial_scale_power``: the
    first overflow would raise the scale to the floor, and a checkpoint's scaler (minimum
    above its scale) would not load on resume (``checkpoint/match.py``)."""
    fp16 = result.fp16
    if not fp16.enabled or fp16.loss_scale:
        return
    start = 2.0 ** fp16.initial_scale_power
    if fp16.min_loss_scale > start:
        raise ConfigError("fp16.min_loss_scale", f"{fp16.min_loss_scale:g} is above the "
                          f"initial scale 2**{fp16.initial_scale_power} = {start:g} "
                          "(fp16.initial_scale_power)", value=fp16.min_loss_scale,
                          suggestion="lower min_loss_scale or raise initial_scale_power")


def ignore_param_offload_below_stage3(result: ZeroTrainConfig) -> ZeroTrainConfig:
    """``offload_param`` below stage 3 is accepted and has no effect, as in DeepSpeed (whose
    stage 1-2 optimizer never reads it; Accelerate's DeepSpeed plugin writes the section at
    every stage). A device other than "none" is then read as "none", with one warning."""
    zero = result.zero_optimization
    offload = zero.offload_param
    if zero.stage >= 3 or offload is None or offload.device == "none":
        return result
    warnings.warn(f'zero_optimization.offload_param (device "{offload.device}") has no effect '
                  f"below ZeRO stage 3: stage {zero.stage} keeps whole parameters on the "
                  "device, as DeepSpeed does", ZeroTrainConfigWarning, stacklevel=3)
    none = offload.model_copy(update={"device": "none"})
    return result.model_copy(update={
        "zero_optimization": zero.model_copy(update={"offload_param": none})})


def _check_unmanaged_accumulation(result: ZeroTrainConfig) -> None:
    """``managed_gradient_accumulation: false`` reduces stage 0-1 gradients in ``step()``,
    after the last backward, so ``overlap_comm`` has no backward to overlap them with;
    refused there, as DeepSpeed asserts (stages 2-3 reduce during every backward)."""
    zero = result.zero_optimization
    if not result.managed_gradient_accumulation and zero.overlap_comm and zero.stage < 2:
        raise AssertedConfigError(
            "zero_optimization.overlap_comm", "managed_gradient_accumulation=False supports "
            f"ZeRO overlap_comm only with ZeRO stage 2 or 3: at stage {zero.stage} the "
            "gradients are reduced in step(), after the last backward, with nothing to "
            "overlap", value=True, suggestion="set overlap_comm to false")


_STAGE3_ONLY = ("zero_hpz_partition_size", "zero_quantized_weights",
                "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
                "mics_shard_size")


def _check_hierarchical(zero: ZeroConfig, world_size: int) -> None:
    """ZeRO++ and MiCS keys: stage 3 only, group sizes that divide the world. Whether a
    group fits in a node is checked once the nodes are known (``zero3.hierarchical.
    build_groups``, when ``factory.build_stage`` builds stage 3)."""
    hpz, mics = zero.zero_hpz_partition_size, zero.mics_shard_size
    active = {"zero_hpz_partition_size": hpz > 1, "zero_quantized_weights":
              zero.zero_quantized_weights, "zero_quantized_gradients":
              zero.zero_quantized_gradients, "zero_quantized_nontrainable_weights":
              zero.zero_quantized_nontrainable_weights, "mics_shard_size": mics != -1}
    for key in _STAGE3_ONLY:
        if active[key] and zero.stage != 3:
            raise ConfigError(f"zero_optimization.{key}", "applies to ZeRO stage 3 (partitioned "
                              f"parameters), but zero_optimization.stage is {zero.stage}",
                              value=getattr(zero, key), suggestion="set stage to 3 or remove it")
    if mics == 0:
        raise ConfigError("zero_optimization.mics_shard_size", "must be a positive number of "
                          "ranks, or -1 to turn MiCS off", value=0)
    for key, size in (("zero_hpz_partition_size", hpz), ("mics_shard_size", mics)):
        if size > 1 and world_size % size:
            raise ConfigError(f"zero_optimization.{key}", f"{size} does not divide the world "
                              f"size {world_size}", value=size,
                              suggestion="use a divisor of the world size, usually the ranks "
                                         "per node")
    if zero.zero_quantized_gradients and mics not in (-1, world_size):
        raise ConfigError("zero_optimization.zero_quantized_gradients", "quantized gradients "
                          "reduce over the whole world through the nodes; they are not "
                          "supported together with mics_shard_size", value=True)
    if hpz > 1 and mics != -1:
        raise ConfigError("zero_optimization.zero_hpz_partition_size", "hpZ and MiCS "
                          "(mics_shard_size) both reshape the stage-3 partition; choose one",
                          value=hpz)


def _check_allreduce_op(op: str) -> None:
    """DeepSpeed's ``gradient_allreduce_op``: ``"mean"`` (its default) is what every stage
    does; ``"sum"`` would leave gradients world-size times larger, which zerotrain does not
    implement, so it is refused rather than silently averaged."""
    if op == "sum":
        raise ConfigError("gradient_allreduce_op", '"sum" is not implemented: zerotrain '
                          "averages gradients over the data-parallel ranks", value=op,
                          suggestion='remove it or set "mean", and scale the loss by the '
                                     "world size to get summed gradients")
    if op != "mean":
        raise ConfigError("gradient_allreduce_op", 'must be "mean" or "sum" (DeepSpeed\'s '
                          "values)", value=op)


# DeepSpeed's stage 1-2 optimizer aligns each rank's all-gather send buffer to 4 bytes
# (2 elements of 16 bits) and asserts that the bucket size is a multiple of that.
_NCCL_START_ALIGNMENT_FACTOR = 2


def _check_allgather_alignment(result: ZeroTrainConfig, walk: _Walk) -> None:
    """An odd ``allgather_bucket_size`` where DeepSpeed's ``DeepSpeedZeroOptimizer`` runs
    (stages 1-2, except stage 1 with bf16, ``grad_accum_dtype: "fp32"`` and no optimizer
    offload, its ``BF16_Optimizer``) is refused as DeepSpeed refuses it. zerotrain's
    gathers need no alignment; refusing keeps a config that runs here one that runs there."""
    zero = result.zero_optimization
    size = int(zero.allgather_bucket_size)
    if zero.stage not in (1, 2) or size % _NCCL_START_ALIGNMENT_FACTOR == 0:
        return
    offloaded = zero.offload_optimizer is not None and zero.offload_optimizer.device != "none"
    if (zero.stage == 1 and result.bf16.enabled and not offloaded
            and result.data_types.grad_accum_dtype == "fp32"):
        return   # DeepSpeed's BF16_Optimizer, which does not assert it
    raise AssertedConfigError(
        walk.user_path("zero_optimization.allgather_bucket_size"),
        "allgather_bucket_size must be a multiple of nccl_start_alignment_factor, "
        f"{_NCCL_START_ALIGNMENT_FACTOR} (DeepSpeed's ZeRO stage 1-2 optimizer asserts it)",
        value=size, suggestion=f"use {size + 1}")
