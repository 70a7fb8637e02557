"""DeepSpeed's keys that the schema does not hold: the ones accepted and ignored, and the
other spellings of keys it does hold.

These are tables, not models, so the reader can tell a real-but-unimplemented DeepSpeed key
from a typo; implementing a key means moving it from here into a section.

Note: why unknown keys error but DeepSpeed-only keys warn
    A misspelt key (``zero_optimisation``) silently falls back to the default, and the run
    trains with a configuration nobody asked for; so a key that neither zerotrain nor DeepSpeed
    knows is an error, with the closest valid key as a hint. A real DeepSpeed key that
    zerotrain has not implemented (``flops_profiler``) is different: the file is
    valid, it was written for DeepSpeed, and refusing it would make sharing configs between
    the two impossible. Those keys are accepted, dropped, and named in one
    ``ZeroTrainConfigWarning`` per load, so the gap is visible without being fatal. They all
    live in ``UNIMPLEMENTED_KEYS``; implementing one means moving it into a model.

Note: what DeepSpeed ignores
    Libraries build configs for DeepSpeed that lean on two of its silences, and through
    the switch they must load here too. TRL prepares a reference model (DPO, KTO, GRPO
    with ``beta > 0``...) from the user's config before transformers fills its
    model-dependent ``"auto"`` values, and adds top-level dotted keys
    (``"zero_optimization.reduce_bucket_size"``). DeepSpeed's section models drop an
    ``"auto"`` value (the key keeps its default), and DeepSpeed never reads a top-level key
    it does not know. zerotrain reads them the same way, naming each in the one warning of
    the load, with this line drawn:

    * ``"auto"`` inside ``zero_optimization`` (and its offload sections) is dropped: the
      default applies, as in DeepSpeed. Elsewhere it stays an error: DeepSpeed fails on it
      or reads it wrongly (``train_batch_size``, optimizer and scheduler ``params``).
    * An unknown top-level key is ignored when it is dotted (no DeepSpeed key has a dot) or
      when no known key is close to it (``difflib`` ratio below ``CLOSE_MATCH``). One that
      a did-you-mean would name (``zero_optimisation``, ``train_batch_szie``) stays an
      error: ignoring it would train with defaults nobody asked for.
    * Inside a section every unknown key stays an error with its did-you-mean.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, List, Sequence


# difflib similarity from which an unknown key is taken for a misspelling of a known one
CLOSE_MATCH = 0.6
# sections whose "auto" values DeepSpeed drops (its DeepSpeedConfigModel); Note "what
# DeepSpeed ignores"
_AUTO_DROPPED_IN = "zero_optimization"


def drops_auto(section: str) -> bool:
    """Whether DeepSpeed reads an "auto" value in ``section`` (a dotted path) as unset."""
    return section == _AUTO_DROPPED_IN or section.startswith(_AUTO_DROPPED_IN + ".")


class ZeroTrainConfigWarning(UserWarning):
    """A config key DeepSpeed knows but zerotrain ignores; the run differs from DeepSpeed's."""


# DeepSpeed keys zerotrain accepts but ignores, by section (dotted path, "" = top level).
_UNIMPLEMENTED_NAMES = {
    "": """aio amp autotuning comet comms_logger
        compression_training csv_monitor curriculum_learning
        data_efficiency dataloader_drop_last disable_allgather disable_python_gc dump_state
        eigenvalue elasticity expert_parallel flops_profiler
        gradient_predivide_factor graph_harvesting hybrid_engine log_level
        memory_breakdown nebula pipeline prescale_gradients
        progressive_layer_drop quantize_training seq_parallel_comm_data_type
        sparse_attention sparse_gradients tensorboard
        timers use_data_before_expert_parallelism vocabulary_size wandb
        weight_quantization""",
    # DeepSpeed takes both the stage3_ alias and the bare field name of its stage-3 options.
    "zero_optimization": """cpu_offload cpu_offload_param cpu_offload_params
        cpu_offload_use_pin_memory elastic_checkpoint enable_sanity_checks
        legacy_stage1 load_from_fp32_weights
        log_trace_cache_warnings memory_efficient_linear mics_hierarchical_params_gather
        override_module_apply pipeline_loading_checkpoint round_robin_gradients
        save_muon_momentum_buffer_in_memory use_multi_rank_bucket_allreduce zenflow
        zeropp_loco_param
        stage3_model_persistence_threshold model_persistence_threshold
        stage3_module_granularity_threshold module_granularity_threshold
        stage3_use_all_reduce_for_fetch_params use_all_reduce_for_fetch_params
        stage3_allgather_sequential allgather_sequential
        stage3_partition_stream_chunk_size partition_stream_chunk_size""",
    "zero_optimization.offload_optimizer": """pipeline_read pipeline_write super_offload
        convert_grad_on_cpu cpuadam_cores_perc""",
    "fp16": "fused_mode",
    "bf16": "immediate_grad_update check_grad_overflow",
    "data_types": "param_dtype buffer_dtype",
    "optimizer": "legacy_fusion",
    "optimizer.params": "max_grad_norm",  # DeepSpeed ignores it too, pointing to gradient_clipping
    # DeepSpeed's DeepCompile options (graph passes zerotrain does not have)
    "compile": """deepcompile free_activation offload_activation offload_opt_states
        double_buffer symmetric_memory dump_graphs debug_log offload_parameters
        sync_before_reduce sync_after_reduce sync_before_allgather sync_after_allgather
        keep_int_input_tensors keep_all_input_tensors""",
    "tensor_parallel": """tp_overlap_comm dtype keep_module_on_host tp tensor_parallel
        injection_policy_tuple replace_with_kernel_inject kernel_inject""",
    "checkpoint": "tag_validation load_universal use_node_local_storage parallel_write",
    "checkpoint.writer": "type io_buffer_size io_buffer_double show_statistics data_parallel",
}
UNIMPLEMENTED_KEYS: Dict[str, FrozenSet[str]] = {
    section: frozenset(names.split()) for section, names in _UNIMPLEMENTED_NAMES.items()}

# DeepSpeed keys that change what training computes: accepted only while they leave the
# feature off (a false/empty value), otherwise refused by name with why, never ignored.
REFUSED_WHEN_ON: Dict[str, str] = {
    "zero_optimization.zenflow": "ZenFlow (stale, asynchronous host updates of the less "
                      "important gradient columns) is not implemented; remove the zenflow "
                      "section (offload_optimizer alone gives the synchronous host update)",
}


# DeepSpeed keys on by default whose "off" changes what training computes: refused when off.
REFUSED_WHEN_OFF: Dict[str, str] = {}


def refused_when_on(path: str, value: object) -> str:
    """Why ``path`` cannot be set to ``value`` ("" when accepted: the feature is off, or
    for a REFUSED_WHEN_OFF key, left on)."""
    if path in REFUSED_WHEN_OFF:
        return "" if value is None or value is True or value == 1 else REFUSED_WHEN_OFF[path]
    off = value in (None, False, 0, "", {}) or (
        isinstance(value, dict) and value.get("enabled", True) is False)
    return "" if off else REFUSED_WHEN_ON.get(path, "")


# Other spellings DeepSpeed accepts for a key, by section: alias -> the key the models use.
_KEY_ALIASES: Dict[str, Dict[str, str]] = {
    "": {"bfloat16": "bf16"},
    "zero_optimization": {
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    },
}


def unimplemented_message(keys: List[str], ignored: Sequence[str] = ()) -> str:
    """The one warning of a load: DeepSpeed keys not implemented, and what was ignored as
    DeepSpeed ignores it (Note "what DeepSpeed ignores")."""
    parts = []
    if keys:
        parts.append("zerotrain accepts but does not implement these DeepSpeed config keys, "
                     "so they have no effect: " + ", ".join(keys))
    if ignored:
        parts.append("ignored as DeepSpeed ignores them: " + ", ".join(ignored))
    return "; ".join(parts)
