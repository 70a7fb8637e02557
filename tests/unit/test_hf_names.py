"""The DeepSpeed names transformers and Accelerate read, through the switch."""
from __future__ import annotations

import math
import os

import pytest
import torch

from zerotrain import as_deepspeed
from zerotrain.config import load_config
from zerotrain.errors import ConfigError


@pytest.fixture
def switch():
    as_deepspeed.install()
    try:
        yield
    finally:
        as_deepspeed.uninstall()


def test_lr_schedule_names_and_checkpoint_utils_are_deepspeeds(switch):
    import deepspeed
    from deepspeed.checkpoint import utils

    assert deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES == [
        "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert utils.get_model_ckpt_name_for_rank("d", "00") == os.path.join(
        "d", "mp_rank_00_model_states.pt")
    assert utils.get_zero_ckpt_name_for_rank("d", 3, 0) == os.path.join(
        "d", "zero_pp_rank_3_mp_rank_00_optim_states.pt")
    assert utils.get_layer_ckpt_name_for_rank("d", "layer_01", 1) == os.path.join(
        "d", "layer_01-model_01_model_states.pt")
    assert sorted(["step10", "step9", "step1"], key=utils.natural_keys) == [
        "step1", "step9", "step10"]
    flat = torch.arange(10.0)
    item = {"a": [flat[2:4], (flat[:1], 5)], "b": "x"}
    out = utils.clone_tensors_for_torch_save(item)
    assert torch.equal(out["a"][0], flat[2:4]) and out["a"][1][1] == 5 and out["b"] == "x"
    assert out["a"][0].untyped_storage().nbytes() == 8   # its own storage, not the buffer's
    assert isinstance(out["a"][1], tuple)


def test_partition_parameters_constructor_wrapper_is_deepspeeds(switch):
    from deepspeed.runtime.zero import partition_parameters as pp

    import zerotrain.zero

    assert pp._orig_torch_arange is torch.arange and pp.Init is zerotrain.zero.Init
    wrapped = pp.zero_wrapper_for_fp_tensor_constructor(torch.ones, torch.bfloat16, "cpu")
    assert wrapped(2).dtype == torch.bfloat16
    assert pp.zero_wrapper_for_fp_tensor_constructor(torch.arange, torch.half)(3).dtype == \
        torch.int64   # integer results keep their dtype


def test_steps_per_print_accepts_inf_and_engine_config_reads_like_a_dict():
    config = load_config({"train_batch_size": 2, "steps_per_print": math.inf,
                          "zero_optimization": {"stage": 2}}, world_size=1)
    assert config.steps_per_print == math.inf
    assert config.get("zero_optimization", {}).get("stage") == 2
    assert config.get("tensor_parallel", {}) == {}
    assert load_config({"train_batch_size": 2, "steps_per_print": 5.0},
                       world_size=1).steps_per_print == 5
    for bad in (2.5, 0, math.nan, True, "10"):
        with pytest.raises(ConfigError, match="steps_per_print"):
            load_config({"train_batch_size": 2, "steps_per_print": bad}, world_size=1)


@pytest.mark.parametrize("extra, key", [
    ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.05}}},
     "zero_optimization.zenflow"),
])
def test_keys_that_change_training_are_refused_by_name_when_on(extra, key):
    with pytest.raises(ConfigError, match=f"^{key}: .*not implemented"):
        load_config({"train_batch_size": 2, **extra}, world_size=1)
    off = {"torch_autocast": {"enabled": False}, "bf16": {"bf16_optimizer_states": False},
           "zero_optimization": {"zenflow": None}}
    load_config({"train_batch_size": 2, **off}, world_size=1)   # off: accepted, no effect


def test_unmanaged_gradient_accumulation_is_read_and_refused_with_overlap_below_stage_2():
    """``managed_gradient_accumulation`` is read (1/0 as booleans, as DeepSpeed reads them);
    unmanaged, stages 0-1 reduce in step(), so overlap_comm is refused there as DeepSpeed
    asserts, with an error that is a ConfigError and an AssertionError."""
    from zerotrain.errors import AssertedConfigError
    for value, managed in ((False, False), (0, False), (True, True), (1, True)):
        config = load_config({"train_batch_size": 2, "managed_gradient_accumulation": value},
                             world_size=1)
        assert config.managed_gradient_accumulation is managed
        assert "managed_gradient_accumulation" not in config.unimplemented_keys
    assert load_config({"train_batch_size": 2}, world_size=1).managed_gradient_accumulation
    for stage in (0, 1):
        with pytest.raises(AssertedConfigError, match="^zero_optimization.overlap_comm: "
                           "managed_gradient_accumulation=False supports ZeRO overlap_comm "
                           "only with ZeRO stage 2") as caught:
            load_config({"train_batch_size": 2, "managed_gradient_accumulation": False,
                         "zero_optimization": {"stage": stage, "overlap_comm": True}},
                        world_size=1)
        assert isinstance(caught.value, AssertionError) and isinstance(caught.value, ConfigError)
    for stage in (2, 3):   # these reduce during every backward: overlap_comm stays on
        load_config({"train_batch_size": 2, "managed_gradient_accumulation": False,
                     "zero_optimization": {"stage": stage, "overlap_comm": True}}, world_size=1)


def test_offload_config_enums_and_offload_states_on_a_host_run(switch, worlds):
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from deepspeed.runtime.zero.offload_states import get_state_devices

    with pytest.raises(ValueError, match="unknown state 'ipg'"):
        get_state_devices(object(), "ipg")

    assert OffloadDeviceEnum.cpu == "cpu" and OffloadDeviceEnum("nvme").name == "nvme"
    assert [e.value for e in OffloadStateTypeEnum] == [
        "optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]
    cpu = {torch.device("cpu")}
    kinds = ("hp_params", "lp_params", "lp_grads", "optim_states")
    for refused, devices in worlds.run(2, _offload_round_trip):
        assert refused
        # the masters the config keeps on the host count (not only what offload_states
        # moves); no optimizer state before the first step, and no staging buffer here
        before, after = ({k: d[k] for k in kinds} for d in devices)
        assert before == {**dict.fromkeys(kinds, cpu), "optim_states": set()}
        assert after == dict.fromkeys(kinds, cpu)
        assert devices[0]["contiguous_grad_buffer"] <= cpu


def _offload_round_trip(rank, world):
    import reference as R

    import zerotrain
    from zerotrain.errors import StateError
    from zerotrain.offload_names import OffloadDeviceEnum, OffloadStateTypeEnum
    from zerotrain.utils import get_state_devices

    model = R.make_model()
    config = R.engine_config(stage=3)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    engine.offload_states(device=OffloadDeviceEnum.cpu)
    engine.reload_states()
    try:
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    except StateError as exc:
        refused = "only 'cpu'" in str(exc)
    devices = []
    engine.backward(engine(*R.micro_batch(0, rank, 0)))
    devices.append({k.value: get_state_devices(engine, k) for k in OffloadStateTypeEnum})
    engine.step()
    engine.backward(engine(*R.micro_batch(1, rank, 0)))
    devices.append({k.value: get_state_devices(engine, k) for k in OffloadStateTypeEnum})
    engine.destroy()
    return refused, devices
