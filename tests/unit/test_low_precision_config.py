"""bf16 masters (``bf16.bf16_master_weights_and_grads``, ``bf16_optimizer_states``) and
``torch_autocast`` in the config and the estimator, without a process group."""
from __future__ import annotations

import copy
import os
import json
import warnings

import pytest

from zerotrain.config import load_config
from zerotrain.errors import AssertedConfigError, ConfigError
from zerotrain.estimate import Placement, ds_config, fp32_accumulation_extra, model_states

GB = 10**9
SEVEN_B = 7 * 10**9
BASE = {"train_batch_size": 2, "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                 "bf16_optimizer_states": True}}


def _with(**sections):
    config = copy.deepcopy(BASE)
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section].update(values)
        else:
            config[section] = values
    return config


def test_bf16_masters_make_masters_and_gradients_bf16():
    config = load_config(BASE, world_size=1)
    assert (config.master_dtype, config.grad_accum_dtype) == ("bf16", "bf16")
    assert not config.unimplemented_keys
    plain = load_config({"train_batch_size": 2, "bf16": {"enabled": True}}, world_size=1)
    assert (plain.master_dtype, plain.grad_accum_dtype) == ("fp32", "fp32")


@pytest.mark.parametrize("change, error, message", [
    ({"zero_optimization": {"stage": 0}}, AssertedConfigError,
     r"^bf16.bf16_master_weights_and_grads: Bf16_master_weights_and_grads is only supported "
     r"with ZeRO Stage 1, 2, or 3"),
    ({"bf16": {"bf16_master_weights_and_grads": False}}, AssertedConfigError,
     r"^bf16.bf16_optimizer_states: bf16_optimizer_states requires "
     r"bf16_master_weights_and_grads to be enabled"),
    ({"bf16": {"bf16_optimizer_states": False}}, ConfigError,
     r"^bf16.bf16_master_weights_and_grads: without bf16.bf16_optimizer_states .*does not "
     r"implement"),
    ({"bf16": {"enabled": False}}, ConfigError,
     r"^bf16.bf16_master_weights_and_grads: .*set bf16.enabled true"),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, ConfigError,
     r"^data_types.grad_accum_dtype: 'fp32' contradicts bf16.bf16_master_weights_and_grads"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                               "nvme_path": "/tmp"}}},
     ConfigError, r"^zero_optimization.offload_optimizer.device: nvme with "
                  r"bf16.bf16_master_weights_and_grads is not implemented"),
    ({"bf16": {"enabled": False, "bf16_master_weights_and_grads": False,
               "bf16_optimizer_states": False},
      "torch_autocast": {"enabled": True, "dtype": "float16"}}, ConfigError,
     r"^torch_autocast.dtype: fp16 autocast .*not implemented"),
    ({"bf16": {"enabled": False, "bf16_master_weights_and_grads": False,
               "bf16_optimizer_states": False}, "fp16": {"enabled": True},
      "torch_autocast": {"enabled": True}}, ConfigError,
     r"^torch_autocast.enabled: torch_autocast beside fp16.enabled .*not implemented"),
])
def test_combinations_deepspeed_or_zerotrain_refuse_are_refused_by_name(change, error,
                                                                         message):
    with pytest.raises(error, match=message):
        load_config(_with(**change), world_size=1)


def test_deepspeeds_bf16_example_config_loads():
    """DeepSpeedExamples training/bf16_master_weight/configs/bf16_full.json's keys: bf16
    masters and moments beside torch_autocast."""
    config = load_config(_with(zero_optimization={"stage": 3}, torch_autocast={
        "enabled": True, "dtype": "torch.bfloat16"}), world_size=1)
    assert config.master_dtype == "bf16" and config.torch_autocast.enabled


def test_torch_autocast_section_is_read_not_ignored():
    config = load_config({"train_batch_size": 2, "torch_autocast": {
        "enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}},
        world_size=1)
    assert config.torch_autocast.enabled and config.torch_autocast.dtype == "bfloat16"
    assert "torch_autocast" not in " ".join(config.unimplemented_keys)
    with pytest.raises(ConfigError, match=r"torch_autocast.*dtype"):
        load_config({"train_batch_size": 2, "torch_autocast": {"dtype": "int8"}},
                    world_size=1)


def test_estimator_counts_bf16_masters_and_moments():
    rows = {r.placement: r for r in model_states(SEVEN_B, gpus_per_node=8,
                                                 optimizer="adam-bf16")}
    assert Placement(0) not in rows   # DeepSpeed asserts stages 1-3
    assert [rows[Placement(s)].formula for s in (1, 2, 3)] == ["4Ψ + 6Ψ/N", "2Ψ + 8Ψ/N",
                                                                 "10Ψ/N"]
    assert rows[Placement(2)].gpu_optimizer == 6 * SEVEN_B / 8   # 2 master + 2 + 2 moments
    assert rows[Placement(2, "cpu")].host_per_node == 6 * SEVEN_B   # per node of 8 GPUs
    assert fp32_accumulation_extra(SEVEN_B, Placement(2), world=8, dtype="bf16",
                                   optimizer="adam-bf16") == 0.0   # gradients are bf16
    with pytest.raises(ValueError, match="needs dtype bf16"):
        model_states(SEVEN_B, gpus_per_node=8, dtype="fp16", optimizer="adam-bf16")


def test_estimator_writes_a_config_with_the_bf16_keys_that_loads():
    config = ds_config(Placement(2, "cpu"), dtype="bf16", optimizer="adam-bf16")
    assert config["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True,
                              "bf16_optimizer_states": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_config(json.loads(json.dumps(config)), world_size=8)
    assert loaded.master_dtype == "bf16"


def test_demo_report_puts_bf16_masters_beside_their_own_formula():
    from zerotrain.demo.report import _memory_lines
    results = {"num_params": 1000, "world_size": 2, "stage": 2,
               "memory": [{"parameters": 2000, "optimizer_state": 3000}]}
    config = {"optimizer": {"type": "AdamW"}, "bf16": dict(BASE["bf16"])}
    text = "\n".join(_memory_lines(results, config))
    assert "6Ψ/N = 0.00" in text and "adam-bf16" in text and "fp32 accum" not in text


_TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                     "configs", "gpt2-tiny.json")


def test_traced_step_with_bf16_states_holds_half_the_optimizer_state(capsys):
    """``zerotrain estimate --optimizer adam-bf16`` with a traced step: the planner runs the
    engine with the two bf16 keys, so its peak holds bf16 masters, moments and gradients."""
    from zerotrain.cli import main
    peaks = {}
    for optimizer in ("adam", "adam-bf16"):
        assert main(["estimate", "--model", _TINY, "--micro-batch", "2", "--seq-len", "32",
                     "--gpus", "2", "--stage", "1", "--backend", "gloo", "--json",
                     "--optimizer", optimizer]) == 0
        peaks[optimizer] = json.loads(capsys.readouterr().out)["breakdown"]
    # half, but for Adam's step counters (a few scalar tensors)
    assert abs(peaks["adam-bf16"]["optimizer_state"] * 2 - peaks["adam"]["optimizer_state"]) <= 16
    assert peaks["adam-bf16"]["gradients"] * 2 == peaks["adam"]["gradients"]   # bf16, not fp32
    with pytest.raises(SystemExit):
        main(["estimate", "--model", _TINY, "--micro-batch", "2", "--seq-len", "32",
              "--stage", "0", "--optimizer", "adam-bf16"])
    assert "needs ZeRO stage 1, 2 or 3" in capsys.readouterr().err
