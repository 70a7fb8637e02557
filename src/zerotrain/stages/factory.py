"""Choosing the stage object: the only place that branches on ``zero_optimization.stage``."""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from .buckets import AllReduceGrads, ReduceScatterAtBoundary, ReduceScatterEveryMicroStep
from ..comm import Communicator
from ..config import ZeroTrainConfig
from ..errors import ConfigError
from ..offload import (DeviceStorage, OffloadPlan, Transfers, build_param_storage, build_storage,
                       build_updater, place_masters)
from ..core.precision import PrecisionPolicy
from .zero3.zero_init import unpartition
from .zero3.stage import PartitionedDataParallel
from .base import Stage, StepOutcome
from .zero12 import ShardedDataParallel, ShardPlan

__all__ = ["Stage", "StepOutcome", "adopt", "build_stage", "deepspeed_kinds",
           "partitions_gradients", "partitions_parameters", "shards_optimizer", "stage_class"]

_GRAD_REDUCTION = {0: AllReduceGrads, 1: ReduceScatterAtBoundary,
                   2: ReduceScatterEveryMicroStep}


def stage_class(stage: int) -> type[PartitionedDataParallel] | type[ShardedDataParallel]:
    """The class of ``zero_optimization.stage``'s object, for what is asked of a stage
    before it exists (``partitions_parameters``); ConfigError for a stage that does not
    exist."""
    if stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", f"stage {stage} does not exist; use 0-3",
                          value=stage)
    return PartitionedDataParallel if stage == 3 else ShardedDataParallel


def shards_optimizer(stage: int) -> bool:
    """Whether ``zero_optimization.stage`` shards the optimizer over the data-parallel
    ranks (stages 1-3); stage 0 steps it whole on every rank, as DDP does."""
    stage_class(stage)   # refuses a stage that does not exist
    return stage != 0


def partitions_gradients(stage: int) -> bool:
    """Whether ``zero_optimization.stage`` keeps only a shard of the gradients on each rank
    (stages 2-3, reduce-scattered in every backward), DeepSpeed's
    ``zero_optimization_partition_gradients()``."""
    return (stage_class(stage).partitions_parameters
            or _GRAD_REDUCTION[stage] is ReduceScatterEveryMicroStep)


def partitions_parameters(stage: int) -> bool:
    """Whether ``zero_optimization.stage`` keeps only a shard of the parameters between
    uses (stage 3), DeepSpeed's ``zero_optimization_partition_weights()``."""
    return stage_class(stage).partitions_parameters


def deepspeed_kinds(config: ZeroTrainConfig) -> frozenset[str]:
    """The DeepSpeed optimizer classes DeepSpeed 0.19 wraps this config's optimizer in.

    Stage 3: ``DeepSpeedZeroOptimizer_Stage3``. Stage 1 with bf16 parameters, fp32 gradient
    accumulation and no optimizer offload: ``BF16_Optimizer``. Stages 1-2 otherwise:
    ``DeepSpeedZeroOptimizer``. Stage 0 in fp16 or bf16: ``FP16_Optimizer``; in fp32 the
    bare torch optimizer (no kind).
    """
    stage = config.zero_optimization.stage
    bf16, fp16 = config.bf16.enabled, config.fp16.enabled
    offload = config.zero_optimization.offload_optimizer
    offloaded = offload is not None and offload.device != "none"
    if stage == 3:
        return frozenset({"DeepSpeedZeroOptimizer_Stage3", "ZeROOptimizer"})
    if stage == 1 and bf16 and config.data_types.grad_accum_dtype == "fp32" and not offloaded:
        return frozenset({"BF16_Optimizer", "ZeROOptimizer"})
    if stage in (1, 2):
        return frozenset({"DeepSpeedZeroOptimizer", "ZeROOptimizer"})
    return frozenset({"FP16_Optimizer"}) if (bf16 or fp16) else frozenset()


def adopt(stage: int, module: nn.Module, comm: Communicator) -> None:
    """Bring a model to the form ``stage`` trains before its stage object is built: a stage
    that trains full parameters gathers those ``zero.Init`` partitioned (collective); stage
    3 keeps them partitioned."""
    if not stage_class(stage).partitions_parameters:
        unpartition(module.parameters(), comm)


def build_stage(stage: int, *, module: nn.Module,
                groups: Sequence[tuple[list[str], list[nn.Parameter]]],
                comm: Communicator, policy: PrecisionPolicy, zero_config,
                make_optimizer: Callable[..., torch.optim.Optimizer],
                average_over: Optional[int] = None) -> Stage:
    """The stage object for ``zero_optimization.stage`` (the only place that branches on it).

    Stage 0 keeps a whole optimizer on every rank (shard world 1) and all-reduces
    gradients; stages 1 and 2 shard the optimizer over the data-parallel world and
    reduce-scatter gradients, at the boundary (1) or every micro-step (2). Stage 3 also
    partitions the parameters, gathering them per unit around their use. With
    ``offload_optimizer`` the fp32 state lives on the host (``offload/``) and is stepped
    there; with ``offload_param`` stage 3 keeps its parameter shards on the host too.

    ``make_optimizer(shards, host_step=...)`` builds the optimizer over one list of shard
    tensors per group; ``host_step`` comes from the storage, so the offload configuration
    is read once, here. ``average_over``: the ranks the summed gradient is divided by when
    not ``comm``'s (sequence parallelism: the N/S data-parallel ranks, Note "the sequence
    mesh" in ``comm/sequence.py``).
    """
    built = _build(stage, module=module, groups=groups, comm=comm, policy=policy,
                   zero_config=zero_config, make_optimizer=make_optimizer)
    if average_over is not None:
        built.data_parallel_world = average_over
    return built


def _build(stage: int, *, module: nn.Module,
           groups: Sequence[tuple[list[str], list[nn.Parameter]]],
           comm: Communicator, policy: PrecisionPolicy, zero_config,
           make_optimizer: Callable[..., torch.optim.Optimizer]
           ) -> Union[ShardedDataParallel, PartitionedDataParallel]:
    stage_class(stage)   # ConfigError for a stage that does not exist
    offload = OffloadPlan.from_config(zero_config)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    transfers = Transfers(device)   # issues and counts host <-> device copies
    storage = build_storage(offload, comm.rank, device, transfers)
    optimizer_here = functools.partial(make_optimizer, host_step=storage.steps_on_host())
    make_updater = functools.partial(build_updater, storage=storage,
                                     delayed=offload.delayed_update,
                                     speculative=offload.speculative,
                                     trace_path=offload.trace_path, rank=comm.rank,
                                     ratio=offload.ratio)
    if stage == 3:
        return PartitionedDataParallel(module, [params for _, params in groups], comm=comm,
                                       policy=policy, zero_config=zero_config,
                                       make_optimizer=optimizer_here, storage=storage,
                                       param_storage=build_param_storage(offload, comm.rank,
                                                                         device, transfers),
                                       make_updater=make_updater,
                                       place_masters=functools.partial(
                                           place_masters, offload, storage,
                                           DeviceStorage(device, transfers)))
    plan = ShardPlan(
        shard_world=1 if stage == 0 else comm.world_size,
        reduce_bucket_numel=offload.record_numel(int(zero_config.reduce_bucket_size)),
        allgather_bucket_numel=int(zero_config.allgather_bucket_size),
        overlap_comm=bool(zero_config.overlap_comm),
        buckets=_GRAD_REDUCTION[stage],
    )
    return ShardedDataParallel(groups, comm=comm, policy=policy, plan=plan,
                               make_optimizer=optimizer_here, storage=storage,
                               make_updater=make_updater)
