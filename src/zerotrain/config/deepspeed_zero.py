"""DeepSpeed's ``zero_optimization`` models by their own names (``runtime.zero.config``).

Code written for DeepSpeed builds these directly (``DeepSpeedZeroConfig(**section)``) to
read a section the way DeepSpeed does: lax types (``1`` for ``true``), the ``stage3_``
aliases (``stage3_prefetch_bucket_size`` is read as ``prefetch_bucket_size``) and the
deprecated keys turned into their replacements (``cpu_offload: true`` becomes an
``offload_optimizer`` on the CPU). They only describe a section: the engine reads its
config through :class:`~zerotrain.config.zero.ZeroConfig`, which also checks the keys
zerotrain does not implement.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .zero import LeafModuleConfig

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig",
           "DeepSpeedZeroOffloadParamConfig", "ZeroStageEnum"]

ZeroStageEnum = Literal[0, 1, 2, 3]
_Device = Literal["none", "cpu", "nvme"]


class _Model(BaseModel):
    """DeepSpeed's config model: unknown keys refused, aliases and field names both read."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True,
                              use_enum_values=True)


class DeepSpeedZeroOffloadParamConfig(_Model):
    device: _Device = "none"
    nvme_path: Optional[Path] = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True


class DeepSpeedZeroOffloadOptimizerConfig(_Model):
    """``pipeline`` is true when either read or write of the NVMe swap is pipelined."""

    device: _Device = "none"
    nvme_path: Optional[Path] = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)

    @property
    def pipeline(self) -> bool:
        return self.pipeline_read or self.pipeline_write


# deprecated key -> (replacement, how its value becomes the replacement's)
_DEPRECATED = {
    "cpu_offload_param": ("offload_param", lambda on: (
        DeepSpeedZeroOffloadParamConfig(device="cpu") if on else None)),
    "cpu_offload": ("offload_optimizer", lambda on: (
        DeepSpeedZeroOffloadOptimizerConfig(device="cpu") if on else None)),
    "stage3_gather_fp16_weights_on_model_save": ("gather_16bit_weights_on_model_save", bool),
}


class DeepSpeedZeroConfig(_Model):
    """The ``zero_optimization`` section with DeepSpeed's names and defaults."""

    stage: ZeroStageEnum = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    overlap_comm: Optional[bool] = None   # None: True at stage 3, else False
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[DeepSpeedZeroOffloadParamConfig] = None
    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = None
    sub_group_size: int = Field(1_000_000_000, ge=0)
    cpu_offload_param: Optional[bool] = None
    cpu_offload_use_pin_memory: Optional[bool] = None
    cpu_offload: Optional[bool] = None
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(100_000, ge=0,
                                             alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(sys.maxsize, ge=0,
                                             alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(
        False, alias="stage3_gather_16bit_weights_on_model_save")
    stage3_gather_fp16_weights_on_model_save: bool = False
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_keys(cls, data: Any) -> Any:
        """A deprecated key sets its replacement unless the replacement is given too."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, (new, convert) in _DEPRECATED.items():
            if data.get(old) is not None and data.get(new) is None:
                data[new] = convert(data[old])
        return data

    @model_validator(mode="after")
    def _elastic_checkpoint_at_stage_3(self) -> "DeepSpeedZeroConfig":
        """DeepSpeed's warning, on zerotrain's root logger (``deepspeed.utils.logger``
        through the switch): the key does nothing at stage 3, whose checkpoints load at
        any data-parallel world size anyway."""
        if self.stage == 3 and self.elastic_checkpoint:
            logging.getLogger("zerotrain").warning(
                "zero_optimization.elastic_checkpoint: ZeRO-3 elastic checkpointing is "
                "deprecated and does nothing; stage 3 checkpoints load at any data-parallel "
                "world size without it (or export them with zero_to_fp32)")
        return self

    @model_validator(mode="after")
    def _overlap_default(self) -> "DeepSpeedZeroConfig":
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        return self
