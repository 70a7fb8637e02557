"""Load a DeepSpeed-style JSON config into typed, validated zerotrain settings.

The models mirror DeepSpeed's JSON keys and defaults, so an existing ``ds_config.json`` loads
unchanged; ``load_config`` is the entry point (``load_activation_checkpointing`` reads that one
section alone) and the only exception they raise for bad input is ``ConfigError``, carrying the
dotted key, the bad value and the likely fix.

Note: why unknown keys error but DeepSpeed-only keys warn
    A misspelt key (``zero_optimisation``) silently falls back to the default, and the run
    trains with a configuration nobody asked for; so a key that neither zerotrain nor DeepSpeed
    knows is an error, with the closest valid key as a hint. A real DeepSpeed key that
    zerotrain has not implemented (``flops_profiler``) is different: the file is
    valid, it was written for DeepSpeed, and refusing it would make sharing configs between
    the two impossible. Those keys are accepted, dropped, and named in one
    ``ZeroTrainConfigWarning`` per load, so the gap is visible without being fatal. They all
    live in ``UNIMPLEMENTED_KEYS``; implementing one means moving it into a model.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import (Annotated, Any, Dict, FrozenSet, List, Literal, Mapping, Optional, Type, Union,
                    get_args)

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError,
                      model_validator)

from .errors import ConfigError

__all__ = [
    "ActivationCheckpointingConfig", "AdamParams", "BF16Config", "CheckpointConfig",
    "CompileConfig",
    "DataTypesConfig", "FP16Config", "OPTIMIZER_PARAMS", "OffloadConfig", "OptimizerConfig",
    "SGDParams", "SchedulerConfig", "UNIMPLEMENTED_KEYS", "ZeroConfig", "ZeroTrainConfig",
    "ZeroTrainConfigWarning", "load_activation_checkpointing", "load_config",
]

PrecisionName = Literal["fp32", "bf16", "fp16"]


class ZeroTrainConfigWarning(UserWarning):
    """A config key DeepSpeed knows but zerotrain ignores; the run differs from DeepSpeed's."""


# DeepSpeed keys zerotrain accepts but ignores, by section (dotted path, "" = top level).
_UNIMPLEMENTED_NAMES = {
    "": """aio amp autotuning comet comms_logger
        compression_training csv_monitor curriculum_learning
        data_efficiency dataloader_drop_last disable_allgather disable_python_gc dump_state
        eigenvalue elasticity expert_parallel flops_profiler gradient_allreduce_op
        gradient_predivide_factor graph_harvesting hybrid_engine log_level
        managed_gradient_accumulation memory_breakdown nebula pipeline prescale_gradients
        progressive_layer_drop quantize_training seq_parallel_comm_data_type
        sequence_parallel_size sparse_attention sparse_gradients tensor_parallel tensorboard
        timers torch_autocast use_data_before_expert_parallelism vocabulary_size wandb
        weight_quantization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer""",
    # DeepSpeed takes both the stage3_ alias and the bare field name of its stage-3 options.
    "zero_optimization": """cpu_offload cpu_offload_param cpu_offload_params
        cpu_offload_use_pin_memory elastic_checkpoint enable_sanity_checks
        ignore_unused_parameters leaf_module legacy_stage1 load_from_fp32_weights
        log_trace_cache_warnings memory_efficient_linear mics_hierarchical_params_gather
        override_module_apply pipeline_loading_checkpoint round_robin_gradients
        save_muon_momentum_buffer_in_memory use_multi_rank_bucket_allreduce zenflow
        zero_quantized_nontrainable_weights zeropp_loco_param
        stage3_model_persistence_threshold model_persistence_threshold
        stage3_module_granularity_threshold module_granularity_threshold
        stage3_use_all_reduce_for_fetch_params use_all_reduce_for_fetch_params
        stage3_allgather_sequential allgather_sequential
        stage3_partition_stream_chunk_size partition_stream_chunk_size""",
    "zero_optimization.offload_optimizer": """pipeline_read pipeline_write super_offload
        convert_grad_on_cpu cpuadam_cores_perc""",
    "fp16": "fused_mode",
    "bf16": """immediate_grad_update check_grad_overflow bf16_master_weights_and_grads
        bf16_optimizer_states""",
    "data_types": "param_dtype buffer_dtype",
    "optimizer": "legacy_fusion",
    "optimizer.params": "max_grad_norm",  # DeepSpeed ignores it too, pointing to gradient_clipping
    # DeepSpeed's DeepCompile options (graph passes zerotrain does not have)
    "compile": """deepcompile free_activation offload_activation offload_opt_states
        double_buffer symmetric_memory dump_graphs debug_log offload_parameters
        sync_before_reduce sync_after_reduce sync_before_allgather sync_after_allgather
        keep_int_input_tensors keep_all_input_tensors""",
    "checkpoint": "tag_validation load_universal use_node_local_storage parallel_write writer",
}
UNIMPLEMENTED_KEYS: Dict[str, FrozenSet[str]] = {
    section: frozenset(names.split()) for section, names in _UNIMPLEMENTED_NAMES.items()}

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


def _whole_number(value: Any) -> Any:
    """Turn 5e8-style floats into ints: DeepSpeed configs routinely write element counts so."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Count = Annotated[int, BeforeValidator(_whole_number), Field(ge=0)]
Size = Annotated[int, BeforeValidator(_whole_number), Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]


class _Section(BaseModel):
    """Base of every section: strict types (no "2" -> 2, no true -> 1), no unknown keys,
    finite floats, and immutable so every component sees the values that were validated."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


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
    offload_optimizer: Optional[OffloadConfig] = None
    offload_param: Optional[OffloadConfig] = None
    # ZeRO++ and MiCS (stage 3; docs/multinode.md)
    zero_hpz_partition_size: Size = 1        # ranks of the secondary partition (hpZ)
    zero_quantized_weights: bool = False     # int8 blocks in the parameter all-gather (qwZ)
    zero_quantized_gradients: bool = False   # int4 hierarchical reduce-scatter (qgZ)
    mics_shard_size: int = Field(-1, ge=-1)  # shard within groups of this size, -1: off


class CheckpointConfig(_Section):
    """``auto_resume``: a save directory; when it holds a ``latest`` tag, ``initialize`` loads
    it, so a job restarted by torchrun continues where the last complete save left off."""

    auto_resume: Optional[str] = None


class FP16Config(_Section):
    enabled: bool = False
    loss_scale: NonNegative = 0.0  # 0 means dynamic loss scaling
    initial_scale_power: int = Field(16, ge=0)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0)
    auto_cast: bool = False
    fp16_master_weights_and_grads: bool = False


class BF16Config(_Section):
    enabled: bool = False


class DataTypesConfig(_Section):
    grad_accum_dtype: Optional[PrecisionName] = None


class AdamParams(_Section):
    """Keys allowed in ``optimizer.params`` for Adam and AdamW; unset keys keep torch's default."""

    lr: Optional[NonNegative] = None
    betas: Optional[List[Annotated[float, Field(ge=0, lt=1)]]] = Field(
        None, min_length=2, max_length=2)
    eps: Optional[NonNegative] = None
    weight_decay: Optional[NonNegative] = None
    amsgrad: Optional[bool] = None
    adam_w_mode: Optional[bool] = None
    bias_correction: Optional[bool] = None
    torch_adam: Optional[bool] = None
    fused: Optional[bool] = None
    foreach: Optional[bool] = None


class SGDParams(_Section):
    """Keys allowed in ``optimizer.params`` for SGD; unset keys keep torch's default."""

    lr: Optional[NonNegative] = None
    momentum: Optional[NonNegative] = None
    dampening: Optional[NonNegative] = None
    weight_decay: Optional[NonNegative] = None
    nesterov: Optional[bool] = None


OPTIMIZER_PARAMS: Dict[str, Type[_Section]] = {
    "Adam": AdamParams, "AdamW": AdamParams, "SGD": SGDParams}
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class OptimizerConfig(_Section):
    """``params`` holds only the keys the user set, validated, with ``betas`` as a tuple."""

    type: Literal["Adam", "AdamW", "SGD"]
    params: Dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(_Section):
    """``params`` is stored as given; the scheduler module validates its keys."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    params: Dict[str, Any] = Field(default_factory=dict)


class ActivationCheckpointingConfig(_Section):
    """DeepSpeed's ``activation_checkpointing`` section, used by ``zerotrain.checkpointing``.

    ``cpu_checkpointing`` keeps checkpointed inputs in host memory; ``synchronize_checkpoint_
    boundary`` synchronizes CUDA around each checkpointed segment; ``profile`` logs each
    segment's forward and recomputation time at DEBUG. ``partition_activations`` and
    ``contiguous_memory_optimization`` (with ``number_checkpoints`` buffers) only act across
    a model-parallel group; in data-parallel training they change nothing (Note "options
    that need model parallelism" in ``checkpointing.py``).
    """

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[Size] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


TORCH_COMPILE_KWARGS = ("mode", "fullgraph", "dynamic", "options", "disable")


class CompileConfig(_Section):
    """``torch.compile`` of the model by the engine (``docs/compile.md``).

    ``enabled``: ``initialize`` calls ``engine.compile`` with ``backend`` and ``kwargs``
    (any of ``TORCH_COMPILE_KWARGS``); ``fallback``: null (a block that fails to compile
    raises an error naming it and the backend) or "eager" (such a block runs eagerly).
    """

    enabled: bool = False
    backend: str = "inductor"
    kwargs: Dict[str, Any] = Field(default_factory=dict)
    fallback: Optional[Literal["eager"]] = None


class ZeroTrainConfig(_Section):
    """The whole validated config; build it with ``load_config``, which resolves the batch sizes."""

    train_batch_size: int = Field(ge=1)
    train_micro_batch_size_per_gpu: int = Field(ge=1)
    gradient_accumulation_steps: int = Field(ge=1)
    gradient_clipping: NonNegative = 0.0
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    steps_per_print: int = Field(10, ge=1)
    wall_clock_breakdown: bool = False
    communication_data_type: Optional[PrecisionName] = None   # gradient reductions
    # zerotrain's own keys (not DeepSpeed's)
    comms_timeout: float = Field(1800.0, gt=0, le=31_536_000, allow_inf_nan=False)  # s
    nonfinite: Literal["raise", "skip"] = "raise"  # bf16/fp32 inf/nan gradients
    debug: bool = False                            # name collectives and units in errors

    _raw: Dict[str, Any] = PrivateAttr(default_factory=dict)
    _unimplemented: List[str] = PrivateAttr(default_factory=list)

    @property
    def precision(self) -> PrecisionName:
        if self.fp16.enabled:
            return "fp16"
        return "bf16" if self.bf16.enabled else "fp32"

    @property
    def comm_dtype(self) -> PrecisionName:
        """The gradient reductions' dtype: the gradients' own (the parameter dtype) unless
        ``communication_data_type`` is set, as in DeepSpeed."""
        return self.communication_data_type or self.precision

    @property
    def grad_accum_dtype(self) -> PrecisionName:
        """fp32 unless set: accumulating many micro-batches in 16 bits loses small gradients."""
        return self.data_types.grad_accum_dtype or "fp32"

    @property
    def raw(self) -> Dict[str, Any]:
        """A deep copy of the user's config, for features that read keys the models lack."""
        return self._raw

    @property
    def unimplemented_keys(self) -> List[str]:
        """Dotted paths of the DeepSpeed keys that were accepted but have no effect."""
        return list(self._unimplemented)


@dataclass
class _Walk:
    """What the key walk learns: DeepSpeed-only keys seen, aliases used (model path -> user's)."""

    unimplemented: List[str] = field(default_factory=list)
    renamed: Dict[str, str] = field(default_factory=dict)

    def user_path(self, path: str) -> str:
        """Spell a model path the way the user did, so errors name the key in their file."""
        for canon, user in sorted(self.renamed.items(), key=lambda item: -len(item[0])):
            if path == canon or path.startswith((canon + ".", canon + "[")):
                return user + path[len(canon):]
        return path


def load_config(config: Union[Mapping[str, Any], str, "os.PathLike[str]", None], *,
                world_size: int, warn_unimplemented: bool = True) -> ZeroTrainConfig:
    """Validate ``config`` (a dict, a JSON file path, or None) for ``world_size`` ranks.

    Raises ConfigError for anything unusable; warns once (ZeroTrainConfigWarning) listing the
    DeepSpeed keys that were accepted but are not implemented, unless ``warn_unimplemented``
    is false (``initialize`` warns itself, on rank 0, at the user's call). The caller's dict
    is not changed.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("", f"world_size must be an integer >= 1, got {world_size!r}")
    raw = _read(config)
    walk = _Walk()
    data = _clean(ZeroTrainConfig, copy.deepcopy(raw), "", "", walk)  # raw stays as given
    _prepare_optimizer(data, walk)
    scheduler = data.get("scheduler")
    if isinstance(scheduler, dict) and "type" in scheduler:
        scheduler["type"] = _choose(scheduler["type"], SCHEDULER_TYPES, "scheduler.type",
                                    ignore_case=False)
    _resolve_batch(data, world_size)
    result = _validate(ZeroTrainConfig, data, "", walk)
    _check_combinations(result, walk)
    _check_hierarchical(result.zero_optimization, world_size)
    result._raw = raw
    result._unimplemented = list(walk.unimplemented)
    if walk.unimplemented and warn_unimplemented:
        warnings.warn(unimplemented_message(walk.unimplemented), ZeroTrainConfigWarning,
                      stacklevel=2)
    return result


def unimplemented_message(keys: List[str]) -> str:
    return ("zerotrain accepts but does not implement these DeepSpeed config keys, so they "
            "have no effect: " + ", ".join(keys))


def read_config_dict(config: Any) -> Dict[str, Any]:
    """The config as a plain dict (a private copy), before any validation.

    For the few values needed before the world size is known (``comms_timeout``).
    """
    return _read(config)


def load_activation_checkpointing(config: Union[Mapping[str, Any], str, "os.PathLike[str]",
                                                 None]) -> ActivationCheckpointingConfig:
    """Validate only the ``activation_checkpointing`` section of ``config`` (a dict or a JSON
    path), with the same key checks as ``load_config``; the defaults when it has none.

    For ``checkpointing.configure``, which DeepSpeed scripts call with the config file and
    which needs no world size; the rest of the file is validated by ``initialize``.
    """
    name = "activation_checkpointing"
    section = _read(config).get(name, {})
    _reject_auto(section, name)
    walk = _Walk()
    data = _clean(ActivationCheckpointingConfig, section, name, name, walk)
    return _validate(ActivationCheckpointingConfig, data, name, walk)


def _read(config: Any) -> Dict[str, Any]:
    """Return a private deep copy of the config as a dict, reading JSON files."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        _check_depth(config, "the config")
        return copy.deepcopy(dict(config))
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError("", "config must be a dict, a path to a JSON file, or None; "
                              f"got {type(config).__name__}")
    path = os.fspath(config)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("", f"cannot read config file {path}: {exc}") from None
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _no_duplicates(pairs, path))
    except json.JSONDecodeError as exc:
        raise ConfigError("", f"config file {path} is not valid JSON: {exc.msg} "
                              f"(line {exc.lineno}, column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:   # a 5000-digit number, deep nesting
        raise ConfigError("", f"config file {path} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"config file {path} must hold a JSON object, "
                              f"not {type(data).__name__}")
    _check_depth(data, f"config file {path}")
    return data


MAX_DEPTH = 64   # far deeper than any DeepSpeed config; deeper would hit Python's recursion


def _check_depth(config: Any, what: str) -> None:
    """ConfigError when dicts and lists nest deeper than MAX_DEPTH (checked without
    recursion, so that the check itself cannot overflow)."""
    stack = [(config, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError("", f"{what} nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)


def _no_duplicates(pairs: List[Any], path: str) -> Dict[str, Any]:
    """Refuse repeated keys: JSON keeps the last one, silently dropping the other setting."""
    result: Dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ConfigError("", f"config file {path} sets key {key!r} twice in one object")
        result[key] = value
    return result


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _section_model(annotation: Any) -> Optional[Type[BaseModel]]:
    """The model a field holds (also inside Optional[...]), or None for a plain value."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _clean(model: Type[BaseModel], data: Any, path: str, canon: str, walk: _Walk) -> Any:
    """Copy ``data`` for ``model``: check every key, reject "auto", resolve aliases, drop
    DeepSpeed-only keys. ``path`` is the user's dotted spelling, ``canon`` the model's."""
    if not isinstance(data, dict):
        return data  # the wrong type is reported by pydantic, with what was expected
    aliases = _KEY_ALIASES.get(canon, {})
    skipped = UNIMPLEMENTED_KEYS.get(canon, frozenset())
    fields = model.model_fields
    out: Dict[str, Any] = {}
    spelled: Dict[str, str] = {}  # model key -> the user's key that set it
    for key, value in data.items():
        where = _join(path, key)
        name = aliases.get(key, key) if isinstance(key, str) else key
        if name in fields:
            if name in spelled:
                raise ConfigError(where, f"sets the same option as {_join(path, spelled[name])}; "
                                         "give only one of them", value=value)
            spelled[name] = key
            _reject_auto(value, where)
            if name != key:
                walk.renamed[_join(canon, name)] = where
            sub = _section_model(fields[name].annotation)
            out[name] = _clean(sub, value, where, _join(canon, name), walk) if sub else value
        elif key in skipped:
            _reject_auto(value, where)
            walk.unimplemented.append(where)
        else:
            raise _unknown_key(key, where, list(fields), [*aliases, *skipped])
    return out


def _reject_auto(value: Any, path: str) -> None:
    """Refuse "auto" at any depth: only the Hugging Face integration knows what to fill in."""
    if isinstance(value, str) and value == "auto":
        raise ConfigError(path, '"auto" values are filled in by the Hugging Face integration; '
                                "zerotrain needs a concrete value here", value=value)
    if isinstance(value, dict):
        for key, item in value.items():
            _reject_auto(item, _join(path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _reject_auto(item, f"{path}[{index}]")


def _unknown_key(key: Any, path: str, valid: List[str], also_known: List[str]) -> ConfigError:
    close = difflib.get_close_matches(str(key), sorted(valid + also_known), n=1, cutoff=0.6)
    if close:
        suggestion: Optional[str] = f"did you mean {close[0]}"
    elif len(valid) <= 12:
        suggestion = "valid keys: " + ", ".join(sorted(valid))
    else:
        suggestion = None
    return ConfigError(path, "unknown config key", value=key, suggestion=suggestion)


def _choose(value: Any, choices: tuple, path: str, *, ignore_case: bool) -> Any:
    """Map ``value`` onto one of ``choices`` (canonical spelling), or explain the miss."""
    if not isinstance(value, str):
        return value  # pydantic reports the type
    for choice in choices:
        if value == choice or (ignore_case and value.lower() == choice.lower()):
            return choice
    lowered = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
    suggestion = f"did you mean {lowered[close[0]]}" if close else None
    raise ConfigError(path, f"unsupported type {value!r}; zerotrain supports "
                            + ", ".join(choices), value=value, suggestion=suggestion)


def _prepare_optimizer(data: Dict[str, Any], walk: _Walk) -> None:
    """Canonicalise ``optimizer.type`` and validate ``optimizer.params`` for that type."""
    section = data.get("optimizer")
    if not isinstance(section, dict) or "type" not in section:
        return  # missing or mistyped: pydantic reports it
    section["type"] = _choose(section["type"], tuple(OPTIMIZER_PARAMS), "optimizer.type",
                              ignore_case=True)
    params = section.get("params", {})
    model = OPTIMIZER_PARAMS.get(section["type"]) if isinstance(section["type"], str) else None
    if model is None or not isinstance(params, dict):
        return
    cleaned = _clean(model, params, "optimizer.params", "optimizer.params", walk)
    values = _validate(model, cleaned, "optimizer.params", walk).model_dump(
        exclude_unset=True, exclude_none=True)
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    section["params"] = values


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


def _validate(model: Type[BaseModel], data: Any, prefix: str, walk: _Walk) -> Any:
    """Run pydantic, turning its first error into a ConfigError at the dotted key."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
    path = prefix
    for part in error["loc"]:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, part)
    path = walk.user_path(path)
    if error["type"] == "missing":
        raise ConfigError(path, "required key is missing")
    value = error.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    message = error["msg"]
    if message.startswith("Input should be "):
        message = f"expected {message[len('Input should be '):]}, got {shown}"
    else:
        message = f"{message}, got {shown}"
    raise ConfigError(path, message, value=value)


def _check_combinations(result: ZeroTrainConfig, walk: _Walk) -> None:
    """Checks that involve two keys, made once each key is valid on its own."""
    if result.fp16.enabled and result.bf16.enabled:
        bf16 = walk.user_path("bf16.enabled")
        raise ConfigError("fp16.enabled", f"fp16.enabled and {bf16} are both true; "
                                          "enable at most one of them", value=True)
    for key in result.compile.kwargs:
        if key not in TORCH_COMPILE_KWARGS:
            raise _unknown_key(key, walk.user_path(f"compile.kwargs.{key}"),
                               list(TORCH_COMPILE_KWARGS), [])
    for name in ("offload_optimizer", "offload_param"):
        offload = getattr(result.zero_optimization, name)
        if offload is not None and offload.device == "nvme" and not offload.nvme_path:
            raise ConfigError(f"zero_optimization.{name}.nvme_path",
                              'is required when device is "nvme"')


_STAGE3_ONLY = ("zero_hpz_partition_size", "zero_quantized_weights",
                "zero_quantized_gradients", "mics_shard_size")


def _check_hierarchical(zero: ZeroConfig, world_size: int) -> None:
    """ZeRO++ and MiCS keys: stage 3 only, group sizes that divide the world. Whether a
    group fits in a node is checked once the nodes are known (``factory.build_stage``)."""
    hpz, mics = zero.zero_hpz_partition_size, zero.mics_shard_size
    active = {"zero_hpz_partition_size": hpz > 1, "zero_quantized_weights":
              zero.zero_quantized_weights, "zero_quantized_gradients":
              zero.zero_quantized_gradients, "mics_shard_size": mics != -1}
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
