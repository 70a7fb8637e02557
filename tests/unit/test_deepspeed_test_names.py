"""The names and readings DeepSpeed's own unit tests (and their harness) take from
``deepspeed``, answered through the switch."""
import logging

import pytest
import torch

from zerotrain import as_deepspeed
from zerotrain.config import load_config
from zerotrain.errors import ConfigError


@pytest.fixture
def deepspeed():
    as_deepspeed.install()
    try:
        import deepspeed
        yield deepspeed
    finally:
        as_deepspeed.uninstall()


def test_cpu_device_count_is_local_size_as_in_deepspeed(monkeypatch):
    from zerotrain.accelerator import Accelerator, is_current_accelerator_supported
    cpu = Accelerator("cpu")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert cpu.device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert cpu.device_count() == 2
    assert is_current_accelerator_supported()


def test_build_and_op_records(deepspeed):
    from deepspeed.git_version_info import torch_info, installed_ops, version
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    from deepspeed.runtime.swap_tensor import MIN_SWAPPABLE_BYTES
    from deepspeed.utils.torch import required_torch_version
    assert version == deepspeed.__version__ and torch_info["version"] == ".".join(
        torch.__version__.split(".")[:2])
    assert not any(installed_ops.values())   # nothing is compiled
    compatible = deepspeed.ops.__compatible_ops__
    assert compatible[CPUAdamBuilder.NAME] and not compatible[AsyncIOBuilder.NAME]
    with pytest.raises(Exception, match="async_io"):
        AsyncIOBuilder().load()
    assert MIN_SWAPPABLE_BYTES == 1024 ** 2
    assert required_torch_version(min_version=1.4)
    assert not required_torch_version(max_version=2.0)
    with pytest.raises(ValueError):
        required_torch_version()


def test_deepspeed_zero_config_reads_aliases_and_deprecated_keys(deepspeed):
    from deepspeed.runtime.zero.config import (DeepSpeedZeroConfig,
                                               DeepSpeedZeroOffloadOptimizerConfig,
                                               DeepSpeedZeroOffloadParamConfig)
    assert DeepSpeedZeroConfig(cpu_offload_param=True).offload_param.device == "cpu"
    assert isinstance(DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer,
                      DeepSpeedZeroOffloadOptimizerConfig)
    assert DeepSpeedZeroConfig(
        stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    assert DeepSpeedZeroConfig(stage3_prefetch_bucket_size=12345).prefetch_bucket_size == 12345
    assert [DeepSpeedZeroConfig(stage=s).overlap_comm for s in range(4)] == [0, 0, 0, 1]
    assert isinstance(DeepSpeedZeroConfig(offload_param={}).offload_param,
                      DeepSpeedZeroOffloadParamConfig)
    assert DeepSpeedZeroConfig().offload_param is None
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline
    assert not DeepSpeedZeroOffloadOptimizerConfig().pipeline
    with pytest.raises(ValueError, match="stage3_prefetch_bucket"):
        DeepSpeedZeroConfig(stage3_prefetch_bucket=1)


def test_a_boolean_key_given_as_one_or_zero_reads_as_deepspeed_reads_it():
    config = load_config({"train_batch_size": 2, "bf16": {"enabled": 1},
                          "zero_optimization": {"stage": 2, "overlap_comm": 1,
                                                "contiguous_gradients": 0}}, world_size=1)
    zero = config.zero_optimization
    assert (config.bf16.enabled, zero.overlap_comm, zero.contiguous_gradients) == (
        True, True, False)
    for bad in (2, "true", 1.0):
        with pytest.raises(ConfigError, match="bf16.enabled"):
            load_config({"train_batch_size": 2, "bf16": {"enabled": bad}}, world_size=1)
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        load_config({"train_batch_size": 2, "zero_optimization": {"stage": True}},
                    world_size=1)


def test_moe_split_returns_the_groups_when_no_parameter_is_an_experts(deepspeed):
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": params, "name": "parameters", "lr": 0.1})
    assert len(groups) == 1 and groups[0]["params"] == params and groups[0]["lr"] == 0.1
    two = ({"params": params[:1], "name": "a"}, {"params": params[1:], "name": "b"})
    assert [g["name"] for g in split_params_into_different_moe_groups_for_optimizer(two)] == [
        "a", "b"]


def test_gradient_allreduce_op_mean_is_read_and_sum_is_refused_by_name():
    base = {"train_batch_size": 2}
    assert load_config({**base, "gradient_allreduce_op": "mean"},
                       world_size=1).gradient_allreduce_op == "mean"
    with pytest.raises(ConfigError, match='gradient_allreduce_op: "sum" is not implemented'):
        load_config({**base, "gradient_allreduce_op": "sum"}, world_size=1)
    with pytest.raises(ConfigError, match="gradient_allreduce_op"):
        load_config({**base, "gradient_allreduce_op": "max"}, world_size=1)


def test_partition_parameters_names_zero_init_base_and_linear_wrap(deepspeed):
    from deepspeed.runtime.zero.partition_parameters import (
        InsertPostInitMethodToModuleSubClasses, zero3_linear_wrap)
    from zerotrain.zero.linear import zero3_linear_wrap as ours
    assert zero3_linear_wrap is ours
    linear = torch.nn.functional.linear
    init = deepspeed.zero.Init(enabled=False, mem_efficient_linear=True)
    assert isinstance(init, InsertPostInitMethodToModuleSubClasses)
    with init:   # F.linear is never replaced, so DeepSpeed's backup of it never exists
        assert torch.nn.functional.linear is linear
    assert not hasattr(InsertPostInitMethodToModuleSubClasses, "linear_bk")


def test_an_odd_allgather_bucket_size_is_refused_where_deepspeed_asserts_it():
    def load(stage, size, **extra):
        return load_config({"train_batch_size": 2, "zero_optimization": {
            "stage": stage, "allgather_bucket_size": size}, **extra}, world_size=1)
    for stage in (1, 2):   # DeepSpeedZeroOptimizer: a ConfigError and its AssertionError
        with pytest.raises(AssertionError, match="must be a multiple of "
                                                 "nccl_start_alignment_factor, 2"):
            load(stage, 1001)
        with pytest.raises(ConfigError, match="zero_optimization.allgather_bucket_size"):
            load(stage, 1001)
        assert load(stage, 1000).zero_optimization.allgather_bucket_size == 1000
    load(0, 1001), load(3, 1001)   # no DeepSpeedZeroOptimizer there
    load(1, 1001, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})   # BF16_Optimizer


def test_load_state_dict_from_zero_checkpoint_loads_the_full_weights(monkeypatch, deepspeed):
    from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
    from zerotrain.checkpoint import consolidate
    full = {"weight": torch.full((2, 3), 7.0), "bias": torch.ones(2)}
    seen = []
    monkeypatch.setattr(consolidate, "get_fp32_state_dict_from_zero_checkpoint",
                        lambda path, tag=None: seen.append((path, tag)) or full)
    model = load_state_dict_from_zero_checkpoint(torch.nn.Linear(3, 2), "ckpt", tag="t")
    assert seen == [("ckpt", "t")]
    assert torch.equal(model.weight, full["weight"]) and torch.equal(model.bias, full["bias"])


def test_zero_runtime_exception_catches_zerotrains_errors(deepspeed):
    from deepspeed.runtime.zero.utils import ZeRORuntimeException
    assert issubclass(ConfigError, ZeRORuntimeException)


def test_leaf_module_defaults_and_offload_models_where_deepspeed_has_them(deepspeed):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.leaf_module_config import (DEFAULT_LEAF_MODULE_CLASSES,
                                                           DEFAULT_LEAF_MODULE_NAMES,
                                                           DEFAULT_LEAF_MODULE_NAME_SUFFIXES)
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    leaf = DeepSpeedZeroConfig(stage=3).leaf_module
    assert leaf.classes == DEFAULT_LEAF_MODULE_CLASSES and DEFAULT_LEAF_MODULE_CLASSES
    assert (leaf.names, leaf.name_suffixes) == (DEFAULT_LEAF_MODULE_NAMES,
                                                DEFAULT_LEAF_MODULE_NAME_SUFFIXES) == ([], [])
    assert DeepSpeedZeroConfig(leaf_module={"names": "block"}).leaf_module.names == ["block"]
    assert load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3}},
                       world_size=1).zero_optimization.leaf_module.classes == leaf.classes
    assert DeepSpeedZeroOffloadOptimizerConfig(device="cpu").device == "cpu"


def test_stage3_local_and_setter_names_are_deepspeeds(deepspeed):
    import deepspeed.utils as ds_utils

    for name in ("safe_get_local_fp32_param", "safe_get_local_grad",
                 "safe_get_local_optimizer_state", "safe_set_local_fp32_param",
                 "safe_set_local_grad", "safe_set_local_optimizer_state", "safe_set_full_grad",
                 "safe_set_full_optimizer_state", "safe_update_full_grad_vectorized"):
        assert callable(getattr(ds_utils, name)), name
    ds_utils.set_log_level_from_string("error")
    assert ds_utils.logger.level == 40
    ds_utils.set_log_level_from_string("info")
    with pytest.raises(ValueError, match="'loud'"):
        ds_utils.set_log_level_from_string("loud")


def _checkpoint_names_job(rank: int, world: int, root: str) -> bool:
    import os

    import zerotrain

    engine, *_ = zerotrain.initialize(model=torch.nn.Linear(4, 4), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.sparse_tensor_module_names == set()
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(root, tag="t")
    assert os.path.isfile(engine._get_optimizer_ckpt_name(root, "t", 0))
    engine.close()
    return True


def test_engine_attributes_deepspeeds_checkpoint_tests_read(worlds, tmp_path):
    """DeepSpeed's checkpoint tests compare ``sparse_tensor_module_names`` across a load and
    wrap ``_get_optimizer_ckpt_name``; the name is the rank's file a save writes."""
    assert worlds.run(1, _checkpoint_names_job, str(tmp_path)) == [True]


def _torch_func_job(rank: int, world: int, ga: int) -> bool:
    import copy

    import zerotrain

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    baseline = copy.deepcopy(model)
    engine, *_ = zerotrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ga,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    x = torch.randn(8)
    for transform in (torch.func.grad, torch.func.jacrev):
        got = transform(lambda xi: engine(xi).sum())(x)
        assert torch.allclose(got, transform(lambda xi: baseline(xi).sum())(x), atol=1e-6)
    batch = torch.stack([x, x + 0.1])
    got = torch.func.vmap(torch.func.grad(lambda xi: engine(xi).sum()))(batch)
    want = torch.func.vmap(torch.func.grad(lambda xi: baseline(xi).sum()))(batch)
    assert torch.allclose(got, want, atol=1e-6)
    engine.backward(engine(x.unsqueeze(0)).sum())   # training backwards still work
    engine.close()
    return True


@pytest.mark.parametrize("ga", [1, 4])
def test_torch_func_transforms_through_the_engine_are_the_modules(worlds, ga):
    """``torch.func.grad``/``jacrev``/``vmap`` on the engine give the module's own results:
    the transform's backward is not a training backward (no accumulation scaling)."""
    assert worlds.run(1, _torch_func_job, ga) == [True]


def test_elastic_checkpoint_at_stage_3_warns_on_the_root_logger(caplog):
    """DeepSpeed's deprecation warning, where its tests patch ``deepspeed.utils.logger``
    (zerotrain's root logger through the switch); below stage 3 the key stays quiet."""
    from zerotrain.config.deepspeed_zero import DeepSpeedZeroConfig

    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
        assert caplog.records == []
        DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    assert [r.name for r in caplog.records] == ["zerotrain"]
    assert "elastic checkpointing is deprecated" in caplog.records[0].getMessage().lower()


def test_zero_ordered_dict_through_the_switch(deepspeed):
    """DeepSpeed's ``_parameters`` container and its helper: a plain dict is converted
    once (the first original kept), and a copy of a bound container leaves the engine's
    watch behind."""
    import copy

    from deepspeed.runtime.zero.parameter_offload import (ZeROOrderedDict,
                                                          ensure_zero_ordered_dict)
    from zerotrain.stages.param_watch import ParameterWatch
    m = torch.nn.Linear(4, 4)
    plain = m._parameters = dict(m._parameters)   # torch's default container
    ensure_zero_ordered_dict(m)
    converted = m._parameters
    assert isinstance(converted, ZeROOrderedDict) and list(converted) == ["weight", "bias"]
    assert m._original_parameters is plain and m.weight is converted["weight"]
    ensure_zero_ordered_dict(m)
    assert m._parameters is converted
    watch = ParameterWatch(m, {id(p) for p in m.parameters()}, gather_external=lambda p: None)
    watch.install()
    m.extra = torch.nn.Parameter(torch.zeros(2))   # noted by the container's __setitem__
    assert list(watch._noted) == [id(m.extra)]
    twin = copy.deepcopy(m)
    assert type(twin._parameters) is ZeROOrderedDict and twin._parameters._watch is None
    assert torch.equal(twin.weight, m.weight) and twin._parameters._parent_module is twin
    watch.uninstall()
    assert m._parameters._watch is None and not m._forward_pre_hooks
