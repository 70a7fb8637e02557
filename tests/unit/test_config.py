"""Tests for zerotrain.config: DeepSpeed JSON in, validated config or a precise ConfigError out."""
from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple, get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from zerotrain.config import (
    OPTIMIZER_PARAMS,
    SGDParams,
    UNIMPLEMENTED_KEYS,
    ZeroConfig,
    ZeroTrainConfig,
    ZeroTrainConfigWarning,
    load_config,
)
from zerotrain.errors import ConfigError

BASE = {"train_batch_size": 8}


def load(extra: Optional[Dict[str, Any]] = None, world_size: int = 1) -> ZeroTrainConfig:
    return load_config({**BASE, **(extra or {})}, world_size=world_size)


def config_error(config: Any, world_size: int = 1) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world_size)
    return info.value


# --- batch-size triangle -------------------------------------------------------------------

@pytest.mark.parametrize("given, world_size, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4}, 3, (24, 4, 2)),
    ({"train_batch_size": 24, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
    ({"train_batch_size": 24}, 3, (24, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
    ({"train_batch_size": 7, "gradient_accumulation_steps": None}, 1, (7, 7, 1)),
])
def test_batch_triangle_resolves(given: Dict[str, Any], world_size: int,
                                 expected: Tuple[int, int, int]) -> None:
    config = load_config(given, world_size=world_size)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == expected


def test_inconsistent_triangle_names_all_three_keys_and_world_size() -> None:
    error = config_error({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                          "gradient_accumulation_steps": 2}, world_size=3)
    assert error.path == "train_batch_size"
    assert ("train_batch_size (32) must equal train_micro_batch_size_per_gpu (4) * "
            "gradient_accumulation_steps (2) * world size (3) = 24") in str(error)


@pytest.mark.parametrize("given, world_size", [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 1),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 3}, 1),
    ({"train_batch_size": 10}, 3),
    ({"train_batch_size": 2}, 3),
])
def test_non_divisible_triangle(given: Dict[str, Any], world_size: int) -> None:
    message = str(config_error(given, world_size))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", f"world size ({world_size})"):
        assert key in message


@pytest.mark.parametrize("given", [{}, None, {"gradient_accumulation_steps": 2}])
def test_triangle_needs_batch_or_micro_batch(given: Optional[Dict[str, Any]]) -> None:
    error = config_error(given)
    assert "train_batch_size or train_micro_batch_size_per_gpu" in str(error)


@pytest.mark.parametrize("value", ["8", 0, -4, True, 8.0, [8]])
def test_batch_values_must_be_positive_ints(value: Any) -> None:
    assert config_error({"train_batch_size": value}).path == "train_batch_size"


def test_world_size_must_be_positive_int() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ConfigError):
            load_config(BASE, world_size=bad)


# --- defaults and accepted values ----------------------------------------------------------

def test_defaults_match_deepspeed() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load(world_size=2)
    assert config.gradient_clipping == 0.0
    assert config.optimizer is None and config.scheduler is None
    assert config.steps_per_print == 10 and config.wall_clock_breakdown is False
    fp16 = config.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window,
            fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale, fp16.auto_cast,
            fp16.fp16_master_weights_and_grads) == (False, 0.0, 16, 1000, 2, False, 1.0, False,
                                                    False)
    assert config.bf16.enabled is False and config.data_types.grad_accum_dtype is None
    zero = config.zero_optimization
    assert zero.stage == 0 and zero.overlap_comm is False and zero.contiguous_gradients is True
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 500_000_000
    assert zero.reduce_scatter is True and zero.allgather_partitions is True
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == zero.stage3_max_reuse_distance == 1_000_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is False
    assert zero.sub_group_size == 1_000_000_000
    assert zero.offload_optimizer is None and zero.offload_param is None
    assert config.precision == "fp32" and config.grad_accum_dtype == "fp32"
    assert config.unimplemented_keys == [] and config.raw == BASE


def test_offload_defaults() -> None:
    offload = load({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
                   ).zero_optimization.offload_optimizer
    assert offload is not None
    assert (offload.device, offload.nvme_path, offload.pin_memory, offload.buffer_count,
            offload.buffer_size, offload.max_in_cpu, offload.ratio, offload.fast_init) == (
        "cpu", None, False, 5, 100_000_000, 1_000_000_000, 1.0, False)


def test_precision_and_grad_accum_dtype() -> None:
    assert load({"fp16": {"enabled": True}}).precision == "fp16"
    bf16 = load({"bf16": {"enabled": True}})
    assert bf16.precision == "bf16" and bf16.grad_accum_dtype == "fp32"
    assert load({"data_types": {"grad_accum_dtype": "bf16"}}).grad_accum_dtype == "bf16"
    assert config_error({**BASE, "data_types": {"grad_accum_dtype": "fp64"}}).path == (
        "data_types.grad_accum_dtype")


def test_optimizer_type_is_case_insensitive_and_canonical() -> None:
    config = load({"optimizer": {"type": "adamw",
                                 "params": {"lr": 1, "betas": [0.9, 0.95], "fused": None}}})
    assert config.optimizer is not None
    assert config.optimizer.type == "AdamW"
    assert config.optimizer.params == {"lr": 1.0, "betas": (0.9, 0.95)}
    assert load({"optimizer": {"type": "sgd"}}).optimizer.type == "SGD"  # type: ignore[union-attr]


def test_scheduler_params_stored_as_given() -> None:
    params = {"warmup_num_steps": 10, "anything": [1, {"x": 2}]}
    config = load({"scheduler": {"type": "WarmupCosineLR", "params": params}})
    assert config.scheduler is not None and config.scheduler.params == params


def test_caller_dict_is_not_mutated_and_raw_is_a_copy() -> None:
    given = {"train_batch_size": 8, "bfloat16": {"enabled": True},
             "optimizer": {"type": "adam", "params": {"betas": [0.9, 0.99]}},
             "zero_optimization": {"stage": 2, "round_robin_gradients": True}}
    before = copy.deepcopy(given)
    with pytest.warns(ZeroTrainConfigWarning):
        config = load_config(given, world_size=2)
    assert given == before
    assert config.raw == before and config.raw is not given
    assert config.raw["bfloat16"] is not given["bfloat16"]


def test_config_is_immutable() -> None:
    config = load()
    with pytest.raises(Exception):
        config.zero_optimization.stage = 3  # type: ignore[misc]


# --- JSON files ----------------------------------------------------------------------------

def test_loads_json_file_from_str_and_path(tmp_path: Path) -> None:
    file = tmp_path / "ds_config.json"
    file.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                "zero_optimization": {"stage": 2}}))
    for source in (file, str(file)):
        config = load_config(source, world_size=2)
        assert config.train_batch_size == 4 and config.zero_optimization.stage == 2


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    assert str(missing) in str(config_error(missing))


def test_bad_json_names_file_line_and_column(tmp_path: Path) -> None:
    file = tmp_path / "bad.json"
    file.write_text('{\n  "train_batch_size": 8,\n  "fp16": {enabled: true}\n}')
    message = str(config_error(file))
    assert str(file) in message and "line 3" in message and "column" in message


@pytest.mark.parametrize("text", ["[1, 2]", '{"train_batch_size": 8, "train_batch_size": 4}'])
def test_json_must_be_one_object_without_repeated_keys(tmp_path: Path, text: str) -> None:
    file = tmp_path / "odd.json"
    file.write_text(text)
    assert str(file) in str(config_error(file))


def test_config_of_wrong_kind() -> None:
    assert "dict" in str(config_error(42))


# --- unknown keys and did-you-mean ---------------------------------------------------------

@pytest.mark.parametrize("config, path, suggestion", [
    ({"zero_optimisation": {"stage": 2}}, "zero_optimisation", "did you mean zero_optimization"),
    ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae", "did you mean stage"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decya": 0.1}}},
     "optimizer.params.weight_decya", "did you mean weight_decay"),
    ({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}},
     "optimizer.params.momentun", "did you mean momentum"),
    ({"scheduler": {"type": "WarmupLr"}}, "scheduler.type", "did you mean WarmupLR"),
    ({"optimizer": {"type": "Adamm"}}, "optimizer.type", "did you mean Adam"),
    ({"fp16": {"enable": True}}, "fp16.enable", "did you mean enabled"),
    ({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}},
     "zero_optimization.offload_optimizer.devcie", "did you mean device"),
    ({"bfloat16": {"enabeld": True}}, "bfloat16.enabeld", "did you mean enabled"),
])
def test_misspelt_keys_suggest_the_closest(config: Dict[str, Any], path: str,
                                           suggestion: str) -> None:
    error = config_error({**BASE, **config})
    assert error.path == path
    assert error.suggestion == suggestion


def test_nothing_close_lists_valid_keys() -> None:
    error = config_error({**BASE, "fp16": {"qqqqqqqq": 1}})
    assert error.suggestion is not None and "loss_scale" in error.suggestion


def test_sgd_rejects_adam_only_params() -> None:
    assert config_error({**BASE, "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}
                        ).path == "optimizer.params.betas"


def test_unsupported_optimizer_lists_supported() -> None:
    error = config_error({**BASE, "optimizer": {"type": "Lamb"}})
    assert error.path == "optimizer.type" and "Adam, AdamW, SGD" in str(error)


# --- wrong types and values ----------------------------------------------------------------

@pytest.mark.parametrize("key, value", [
    ("stage", "2"), ("stage", 5), ("stage", True), ("stage", -1), ("stage", 2.0),
    ("reduce_bucket_size", -1), ("reduce_bucket_size", 0), ("reduce_bucket_size", True),
    ("reduce_bucket_size", 5.5), ("reduce_bucket_size", "5e8"), ("overlap_comm", 2),
    ("overlap_comm", "true"), ("stage3_param_persistence_threshold", -1),
])
def test_zero_wrong_types_and_values(key: str, value: Any) -> None:
    error = config_error({**BASE, "zero_optimization": {key: value}})
    assert error.path == f"zero_optimization.{key}"
    assert error.value == value and repr(value) in str(error)


def test_whole_float_sizes_become_ints() -> None:
    zero = load({"zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8,
                                       "stage3_param_persistence_threshold": 0}}
                ).zero_optimization
    assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.allgather_bucket_size == 200_000_000
    assert zero.stage3_param_persistence_threshold == 0


@pytest.mark.parametrize("config, path", [
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping"),
    ({"steps_per_print": 0}, "steps_per_print"),
    ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window"),
    ({"fp16": "on"}, "fp16"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}},
     "optimizer.params.betas[1]"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "Adam", "params": {"lr": "0.1"}}}, "optimizer.params.lr"),
    ({"optimizer": {"params": {}}}, "optimizer.type"),
    ({"optimizer": {"type": 3}}, "optimizer.type"),
    ({"scheduler": {"type": "WarmupLR", "params": []}}, "scheduler.params"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}},
     "zero_optimization.offload_optimizer.ratio"),
])
def test_wrong_values_name_the_dotted_key(config: Dict[str, Any], path: str) -> None:
    assert config_error({**BASE, **config}).path == path


@pytest.mark.parametrize("fp16, path", [
    ({"initial_scale_power": 1000}, "fp16.initial_scale_power"),   # 2**1000 is inf in fp32
    ({"initial_scale_power": 65}, "fp16.initial_scale_power"),
    ({"initial_scale_power": 10**30}, "fp16.initial_scale_power"),
    ({"loss_scale": 1e300}, "fp16.loss_scale"),
    ({"min_loss_scale": 1e300}, "fp16.min_loss_scale"),
    ({"min_loss_scale": 1e9}, "fp16.min_loss_scale"),   # above 2**16, the initial scale
    ({"min_loss_scale": 4.0, "initial_scale_power": 1}, "fp16.min_loss_scale"),
])
def test_loss_scales_that_skip_every_step_are_refused(fp16: Dict[str, Any], path: str) -> None:
    error = config_error({**BASE, "fp16": {"enabled": True, **fp16}})
    assert error.path == path, str(error)


def test_loss_scale_bounds_keep_the_usual_values() -> None:
    fp16 = load({"fp16": {"enabled": True, "initial_scale_power": 64,
                          "min_loss_scale": 2.0 ** 64}}).fp16
    assert fp16.initial_scale_power == 64
    static = load({"fp16": {"enabled": True, "loss_scale": 2.0 ** 64, "min_loss_scale": 1e9}})
    assert static.fp16.loss_scale == 2.0 ** 64   # a static scale has no floor to check


def test_gradient_clipping_accepts_int() -> None:
    assert load({"gradient_clipping": 1}).gradient_clipping == 1.0


def test_fp16_and_bf16_both_enabled() -> None:
    message = str(config_error({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    assert "fp16.enabled" in message and "bf16.enabled" in message


def test_bfloat16_alias() -> None:
    assert load({"bfloat16": {"enabled": True}}).precision == "bf16"
    assert config_error({**BASE, "bf16": {}, "bfloat16": {}}).path == "bfloat16"
    assert config_error({**BASE, "bfloat16": {"enabled": 2}}).path == "bfloat16.enabled"
    assert "bfloat16.enabled" in str(
        config_error({**BASE, "fp16": {"enabled": True}, "bfloat16": {"enabled": True}}))


def test_deepspeed_field_name_aliases_for_stage3_keys() -> None:
    zero = load({"zero_optimization": {"prefetch_bucket_size": 1e6}}).zero_optimization
    assert zero.stage3_prefetch_bucket_size == 1_000_000
    error = config_error({**BASE, "zero_optimization": {"prefetch_bucket_size": 1,
                                                        "stage3_prefetch_bucket_size": 2}})
    assert "prefetch_bucket_size" in str(error)
    assert config_error({**BASE, "zero_optimization": {"max_live_parameters": -1}}).path == (
        "zero_optimization.max_live_parameters")


@pytest.mark.parametrize("config, path", [
    ({"train_batch_size": "auto"}, "train_batch_size"),
    ({**BASE, "gradient_clipping": "auto"}, "gradient_clipping"),
    ({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
    ({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
     "scheduler.params.warmup_max_lr"),
    ({**BASE, "fp16": {"enabled": "auto"}}, "fp16.enabled"),
    ({**BASE, "zero_optimization": "auto"}, "zero_optimization"),
])
def test_auto_is_rejected(config: Dict[str, Any], path: str) -> None:
    error = config_error(config)
    assert error.path == path and "Hugging Face" in str(error)


def test_nvme_offload_needs_a_path() -> None:
    for name in ("offload_optimizer", "offload_param"):
        stage = {"stage": 3}   # offload_param has no effect below stage 3 (test below)
        error = config_error({**BASE, "zero_optimization": {**stage, name: {"device": "nvme"}}})
        assert error.path == f"zero_optimization.{name}.nvme_path"
        config = load({"zero_optimization": {**stage, name: {"device": "nvme",
                                                             "nvme_path": "/nvme"}}})
        assert getattr(config.zero_optimization, name).nvme_path == "/nvme"


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("device", ["cpu", "nvme", "none"])
def test_offload_param_below_stage3_is_accepted_with_no_effect(stage, device) -> None:
    """As DeepSpeed (whose stage 1-2 optimizer never reads it; Accelerate writes the section
    at every stage): read as device "none", one warning when it asked for more."""
    import warnings

    from zerotrain.config import ZeroTrainConfigWarning

    section = {"device": device, "pin_memory": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load({"zero_optimization": {"stage": stage, "offload_param": section}})
    ours = [w for w in caught if issubclass(w.category, ZeroTrainConfigWarning)]
    assert config.zero_optimization.offload_param.device == "none"
    if device == "none":
        assert not ours
    else:
        assert len(ours) == 1
        assert str(ours[0].message) == (
            f'zero_optimization.offload_param (device "{device}") has no effect below ZeRO '
            f"stage 3: stage {stage} keeps whole parameters on the device, as DeepSpeed does")


# --- DeepSpeed keys that are accepted but not implemented ----------------------------------

def test_unimplemented_keys_warn_once_listing_all() -> None:
    config = {**BASE, "flops_profiler": {"enabled": True},
              "tensorboard": {"enabled": True},
              "zero_optimization": {"stage": 2, "round_robin_gradients": True},
              "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config(config, world_size=1)
    ours = [w for w in caught if issubclass(w.category, ZeroTrainConfigWarning)]
    assert len(ours) == 1
    expected = ["flops_profiler", "tensorboard",
                "zero_optimization.round_robin_gradients", "optimizer.params.max_grad_norm"]
    for path in expected:
        assert path in str(ours[0].message)
    assert sorted(loaded.unimplemented_keys) == sorted(expected)
    assert loaded.optimizer is not None and loaded.optimizer.params == {}
    assert loaded.zero_optimization.stage == 2


# --- what DeepSpeed ignores (Note "what DeepSpeed ignores" in config/keys.py) ---------------

# TRL's reference-model config at ZeRO-3: the user's "auto" bucket sizes not yet filled, and
# its model-dependent values added as top-level dotted keys
TRL_REFERENCE = {**BASE, "zero_optimization": {
    "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "param_persistence_threshold": "auto", "offload_param": {"device": "auto"}},
    "zero_optimization.reduce_bucket_size": 4096,
    "zero_optimization.stage3_param_persistence_threshold": 640}


def _load_warned(config: Dict[str, Any]) -> Tuple[ZeroTrainConfig, list]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config(config, world_size=1)
    return loaded, [w for w in caught if issubclass(w.category, ZeroTrainConfigWarning)]


def test_auto_in_zero_optimization_takes_deepspeeds_default_with_one_warning() -> None:
    loaded, ours = _load_warned(TRL_REFERENCE)
    default = ZeroConfig()
    zero = loaded.zero_optimization
    assert zero.stage == 3
    assert zero.reduce_bucket_size == default.reduce_bucket_size
    assert zero.stage3_prefetch_bucket_size == default.stage3_prefetch_bucket_size
    assert zero.stage3_param_persistence_threshold == default.stage3_param_persistence_threshold
    assert zero.offload_param is None or zero.offload_param.device == "none"
    assert len(ours) == 1
    message = str(ours[0].message)
    for path in ("zero_optimization.reduce_bucket_size", "zero_optimization.offload_param.device",
                 "zero_optimization.param_persistence_threshold",
                 "zero_optimization.stage3_param_persistence_threshold"):
        assert path in message
    assert len(loaded.ignored_keys) == 6 and loaded.unimplemented_keys == []


def test_dotted_and_far_top_level_keys_are_ignored_like_deepspeed() -> None:
    loaded, ours = _load_warned({**BASE, "zero_optimization.stage": 3, "my_run_note": "x",
                                 "flops_profiler": {"enabled": True}})
    assert loaded.zero_optimization.stage == 0        # a dotted key sets nothing, as in DeepSpeed
    assert len(ours) == 1                             # one warning: unimplemented and ignored
    message = str(ours[0].message)
    assert "zero_optimization.stage (a dotted top-level key)" in message
    assert "my_run_note (an unknown top-level key)" in message and "flops_profiler" in message
    assert loaded.unimplemented_keys == ["flops_profiler"]


@pytest.mark.parametrize("config, path, suggestion", [
    ({"zero_optimisation": {"stage": 3}}, "zero_optimisation", "did you mean zero_optimization"),
    ({"train_batch_szie": 8}, "train_batch_szie", "did you mean train_batch_size"),
    ({**TRL_REFERENCE, "zero_optimization": {"stage": 3, "reduce_bucket_sise": "auto"}},
     "zero_optimization.reduce_bucket_sise", "did you mean reduce_bucket_size"),
    ({"zero_optimization": {"offload_param": {"devcie": "auto"}}},
     "zero_optimization.offload_param.devcie", "did you mean device"),
])
def test_misspellings_stay_errors_next_to_what_is_ignored(config: Dict[str, Any], path: str,
                                                          suggestion: str) -> None:
    error = config_error({**BASE, **config})
    assert (error.path, error.suggestion) == (path, suggestion)


def test_auto_outside_zero_optimization_stays_an_error() -> None:
    # DeepSpeed fails on these or reads them wrongly; only zero_optimization's model drops them
    assert config_error({**TRL_REFERENCE, "gradient_clipping": "auto"}).path == "gradient_clipping"
    assert config_error({**BASE, "zero_optimization": "auto"}).path == "zero_optimization"


def test_unimplemented_keys_still_reject_auto() -> None:
    error = config_error({**BASE, "flops_profiler": {"profile_step": "auto"}})
    assert error.path == "flops_profiler.profile_step"


def test_implemented_keys_are_not_listed_as_unimplemented() -> None:
    implemented = set(ZeroTrainConfig.model_fields) | {"bfloat16"}
    assert not implemented & UNIMPLEMENTED_KEYS[""]
    assert not set(ZeroConfig.model_fields) & UNIMPLEMENTED_KEYS["zero_optimization"]


# --- fuzz: any JSON value at any supported key gives a config or a ConfigError there -------

def _section(annotation: Any) -> Optional[type]:
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _key_paths(model: type, prefix: str = "") -> Iterator[str]:
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        path = f"{prefix}.{name}" if prefix else name
        yield path
        sub = _section(info.annotation)
        if sub is not None:
            yield from _key_paths(sub, path)


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
PARAM_PATHS = sorted({f"optimizer.params.{name}" for model in OPTIMIZER_PARAMS.values()
                      for name in model.model_fields})
ALL_PATHS = [*_key_paths(ZeroTrainConfig), "bfloat16", "bfloat16.enabled", *PARAM_PATHS]
# Checks that span two keys may report the sibling that has to change.
RELATED = {**{key: BATCH_KEYS for key in BATCH_KEYS},
           **{f"zero_optimization.{name}.device": (f"zero_optimization.{name}.device",
                                                   f"zero_optimization.{name}.nvme_path")
              for name in ("offload_optimizer", "offload_param")}}

SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
           | st.sampled_from(["auto", "cpu", "nvme", "Adam", "sgd", "WarmupLR", "fp16"]))
KEYS = st.text(max_size=8) | st.sampled_from(
    ["enabled", "stage", "type", "params", "device", "lr", "betas", "nvme_path",
     "round_robin_gradients", "bfloat16"])
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8)


def _config_with(path: str, value: Any) -> Dict[str, Any]:
    if path in BATCH_KEYS:
        config: Dict[str, Any] = {} if path != "gradient_accumulation_steps" else {
            "train_micro_batch_size_per_gpu": 1}
    else:
        kind = "SGD" if path.startswith("optimizer.params.") and (
            path.rsplit(".", 1)[1] not in OPTIMIZER_PARAMS["Adam"].model_fields) else "Adam"
        config = {"train_batch_size": 1, "optimizer": {"type": kind, "params": {}},
                  "scheduler": {"type": "WarmupLR"}}
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


def _within(error_path: str, allowed: Tuple[str, ...]) -> bool:
    return any(error_path == p or error_path.startswith((p + ".", p + "[")) for p in allowed)


def test_fuzz_covers_every_section() -> None:
    assert "zero_optimization.offload_param.nvme_path" in ALL_PATHS
    assert "optimizer.params.nesterov" in ALL_PATHS and "optimizer.params.betas" in ALL_PATHS
    assert set(SGDParams.model_fields) <= {p.rsplit(".", 1)[1] for p in PARAM_PATHS}


@pytest.mark.parametrize("path", ALL_PATHS)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=JSON_VALUES)
def test_any_json_value_gives_config_or_config_error_at_that_key(path: str, value: Any) -> None:
    config = _config_with(path, value)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ZeroTrainConfigWarning)
            load_config(config, world_size=1)
    except ConfigError as error:
        assert _within(error.path, RELATED.get(path, (path,))), (path, error.path, str(error))
