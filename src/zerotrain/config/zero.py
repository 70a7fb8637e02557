"""The ``zero_optimization`` section and its two offload subsections.

Kept apart from the other sections because it is the one the stages, offload storages and
hierarchical groups all read, and the one DeepSpeed keeps growing.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from .fields import Count, Size, _Section


class OffloadConfig(_Section):
    """``offload_optimizer`` and ``offload_param`` share one model (DeepSpeed has two); so
    ``ratio``/``fast_init`` are accepted under both and ``buffer_count`` defaults to 5 for both."""

    device: Literal["cpu", "nvme", "none"] = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = False
    buffer_count: Count = 5
    buffer_size: Size = 100_000_000
    max_in_cpu: Count = 1_000_000_000
    ratio: float = Field(1.0, ge=0, le=1)
    fast_init: bool = False
    dpu: bool = False   # offload_optimizer: one-step delayed parameter update (ZeRO-Offload)
    # offload_optimizer, zerotrain's own (docs/offload.md): step records on the host during
    # backward, validated after it; write a Chrome trace of the host step per record
    speculative: bool = False
    trace_path: Optional[str] = None


# DeepSpeed 0.19's defaults (``deepspeed.runtime.zero.leaf_module_config``'s names)
DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


class LeafModuleConfig(_Section):
    """``leaf_module``: modules stage 3 gathers whole (Note "leaf modules" in
    ``zero3/leaf.py``). DeepSpeed 0.19's defaults: the Mixtral, Qwen2-MoE and Qwen3-MoE
    sparse blocks, by class name; a single string is a list of one."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))

    @model_validator(mode="before")
    @classmethod
    def _one_string(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: [v] if isinstance(v, str) and k in ("classes", "names", "name_suffixes")
                    else v for k, v in data.items()}
        return data


DeepSpeedZeroLeafModuleConfig = LeafModuleConfig   # DeepSpeed's name


class ZeroConfig(_Section):
    """``overlap_comm`` defaults to True at stage 3 and False below, as in DeepSpeed.
    Bucket sizes must be > 0; thresholds and distances may be 0, as in DeepSpeed."""

    stage: int = Field(0, ge=0, le=3)
    overlap_comm: bool = False

    @model_validator(mode="before")
    @classmethod
    def _overlap_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and "overlap_comm" not in data:
            data = {**data, "overlap_comm": data.get("stage") == 3}
        return data

    contiguous_gradients: bool = True
    reduce_bucket_size: Size = 500_000_000
    allgather_bucket_size: Size = 500_000_000
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    stage3_prefetch_bucket_size: Count = 50_000_000
    stage3_param_persistence_threshold: Count = 100_000
    stage3_max_live_parameters: Count = 1_000_000_000
    stage3_max_reuse_distance: Count = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    sub_group_size: Size = 1_000_000_000
    ignore_unused_parameters: bool = True   # False: a parameter with no gradient is an error
    offload_optimizer: Optional[OffloadConfig] = None
    offload_param: Optional[OffloadConfig] = None
    # ZeRO++ and MiCS (stage 3; docs/multinode.md)
    zero_hpz_partition_size: Size = 1        # ranks of the secondary partition (hpZ)
    zero_quantized_weights: bool = False     # int8 blocks in the parameter all-gather (qwZ)
    zero_quantized_gradients: bool = False   # int4 hierarchical reduce-scatter (qgZ)
    zero_quantized_nontrainable_weights: bool = False   # frozen shards kept as int8
    mics_shard_size: int = Field(-1, ge=-1)  # shard within groups of this size, -1: off
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
