"""zerotrain.checkpointing: DeepSpeed's activation-checkpointing API on one process."""
from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerotrain import checkpointing, recompute
from zerotrain.config import (ActivationCheckpointingConfig, ZeroTrainConfigWarning,
                              load_activation_checkpointing, load_config)
from zerotrain.errors import ConfigError


@pytest.fixture(autouse=True)
def restored_settings():
    """Settings are module state (as in DeepSpeed); every test leaves them as found."""
    saved = recompute._settings, recompute._configured
    yield
    recompute._settings, recompute._configured = saved


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.25)

    def forward(self, x, scale=1.0, *, shift=None):
        out = x + self.down(self.drop(F.gelu(self.up(x)))) * scale
        return out if shift is None else out + shift


def _mlp(seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(Block() for _ in range(3))


def _grads(blocks: nn.ModuleList, run_block, x: torch.Tensor) -> tuple:
    """Forward through every block with ``run_block``, backward, return output and grads."""
    torch.manual_seed(123)  # dropout draws from here
    x = x.clone().requires_grad_(True)
    h = x
    for i, block in enumerate(blocks):
        h = run_block(block, h, i)
    h.pow(2).mean().backward()
    grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad(set_to_none=True)
    return h.detach(), grads


def _plain(block, h, i):
    return block(h, 0.5) if i % 2 else block(h)


def _checkpointed(block, h, i):
    if i == 2:  # a tensor keyword argument takes part in autograd like a positional one
        return checkpointing.checkpoint(block, h, 1.0, shift=h * 0.1)
    return checkpointing.checkpoint(block, h, 0.5) if i % 2 else checkpointing.checkpoint(block, h)


def _plain_with_shift(block, h, i):
    return block(h, 1.0, shift=h * 0.1) if i == 2 else _plain(block, h, i)


def _assert_bitwise(a: tuple, b: tuple) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.equal(ga, gb)


def test_checkpoint_gives_bitwise_the_gradients_of_no_checkpoint_with_dropout():
    blocks, x = _mlp(), torch.randn(6, 16)
    plain = _grads(blocks, _plain_with_shift, x)
    checkpointed = _grads(blocks, _checkpointed, x)
    _assert_bitwise(plain, checkpointed)
    torch.manual_seed(123)
    assert not torch.equal(blocks[0](x), blocks[0](x))  # dropout really is random here


def test_cpu_checkpointing_keeps_the_saved_inputs_on_the_host_with_identical_results(
        monkeypatch):
    blocks, x = _mlp(), torch.randn(6, 16)
    plain = _grads(blocks, _plain_with_shift, x)
    packed = []
    real = torch.autograd.graph.save_on_cpu

    class Recording(real):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory=pin_memory, device_type=device_type)
            pack = self.pack_hook

            def recording_pack(tensor):
                packed.append(tuple(tensor.shape))
                return pack(tensor)
            self.pack_hook = recording_pack

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Recording)
    checkpointing.configure(None, checkpoint_in_cpu=True)
    offloaded = _grads(blocks, _checkpointed, x)
    _assert_bitwise(plain, offloaded)
    # exactly the segments' tensor inputs went through the host hooks: (6, 16) per block,
    # plus block 2's shift; the weights and inner activations are not saved at all
    assert packed == [(6, 16), (6, 16), (6, 16), (6, 16)]


def test_outputs_follow_deepspeeds_convention():
    x = torch.randn(2, 3, requires_grad=True)
    assert checkpointing.checkpoint(lambda t: t * 2, x).shape == (2, 3)
    single = checkpointing.checkpoint(lambda t: (t * 2,), x)
    assert isinstance(single, torch.Tensor)
    pair = checkpointing.checkpoint(lambda t: [t * 2, t + 1], x)
    assert isinstance(pair, tuple) and len(pair) == 2
    mixed = checkpointing.checkpoint(lambda t, n: (t * n, n), x, 3)
    assert mixed[1] == 3 and torch.equal(mixed[0], x * 3)
    as_dict = checkpointing.checkpoint(lambda t: {"y": t * 2}, x)
    assert set(as_dict) == {"y"}
    (pair[0].sum() + pair[1].sum()).backward()
    assert torch.equal(x.grad, torch.full((2, 3), 3.0))
    assert checkpointing.non_reentrant_checkpoint is checkpointing.checkpoint


def test_inputs_without_grad_nesting_and_autograd_grad_work():
    """What torch's non-reentrant checkpoint adds over DeepSpeed's reentrant one."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4)  # requires no grad: the parameters still get theirs
    checkpointing.checkpoint(first, x).sum().backward()
    assert first.weight.grad is not None
    x.requires_grad_(True)

    def nested(t):
        return checkpointing.checkpoint(second, torch.tanh(checkpointing.checkpoint(first, t)))

    got = torch.autograd.grad(checkpointing.checkpoint(nested, x).sum(), [x, first.weight])
    expected = torch.autograd.grad(second(torch.tanh(first(x))).sum(), [x, first.weight])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_checkpoint_without_grad_just_runs_the_function():
    block = Block()
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.manual_seed(0)
        expected = block(x)
        torch.manual_seed(0)
        assert torch.equal(checkpointing.checkpoint(block, x), expected)


def test_profile_logs_forward_and_recompute_times_at_debug():
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("zerotrain.checkpointing")
    handler, level = Collect(level=logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        checkpointing.configure(None, profile=True, synchronize=True)
        blocks, x = _mlp(), torch.randn(6, 16)
        _assert_bitwise(_grads(blocks, _plain_with_shift, x), _grads(blocks, _checkpointed, x))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    timed = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
    assert sum("forward" in m for m in timed) == 3 and sum("recompute" in m for m in timed) == 3


# --------------------------------------------------------------------------- configure
SECTION = {"partition_activations": True, "cpu_checkpointing": True,
           "contiguous_memory_optimization": False, "number_checkpoints": 4,
           "synchronize_checkpoint_boundary": False, "profile": True}


def test_configure_reads_the_section_from_a_dict_a_path_or_a_config_object(tmp_path):
    assert not checkpointing.is_configured()
    assert checkpointing.current_settings() == ActivationCheckpointingConfig()
    config = {"train_batch_size": 8, "activation_checkpointing": SECTION}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    for source in (config, str(path), path, load_config(config, world_size=1),
                   ActivationCheckpointingConfig(**SECTION)):
        checkpointing.configure(None, deepspeed_config=source)
        assert checkpointing.is_configured()
        assert checkpointing.current_settings().model_dump() == SECTION, source


def test_configure_arguments_override_the_config_and_start_from_the_defaults():
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": SECTION},
                            checkpoint_in_cpu=False, num_checkpoints=7, synchronize=True)
    settings = checkpointing.current_settings()
    assert (settings.cpu_checkpointing, settings.number_checkpoints,
            settings.synchronize_checkpoint_boundary, settings.partition_activations) == (
        False, 7, True, True)
    checkpointing.configure()  # as in DeepSpeed: every call starts from the defaults
    assert checkpointing.current_settings() == ActivationCheckpointingConfig()
    checkpointing.reset()  # frees buffers in DeepSpeed; settings stay
    assert checkpointing.is_configured()


def test_partition_and_contiguous_without_model_parallelism_give_identical_gradients():
    blocks, x = _mlp(), torch.randn(6, 16)
    plain = _grads(blocks, _plain_with_shift, x)
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True,
                            num_checkpoints=3)
    _assert_bitwise(plain, _grads(blocks, _checkpointed, x))


class FakeMpu:
    def __init__(self, size: int) -> None:
        self.size = size

    def get_model_parallel_world_size(self) -> int:
        return self.size

    def get_model_parallel_rank(self) -> int:
        return 0


class FakeMegatronMpu:
    def get_tensor_model_parallel_world_size(self) -> int:
        return 4


def test_model_parallel_world_above_one_is_refused():
    checkpointing.configure(FakeMpu(1), partition_activations=True)  # like DeepSpeed's mp 1
    for mpu in (FakeMpu(2), FakeMegatronMpu()):
        with pytest.raises(ConfigError, match="model-parallel world size is [24]") as info:
            checkpointing.configure(mpu, partition_activations=True)
        assert info.value.path == "mpu"
    with pytest.raises(ConfigError, match="get_model_parallel_world_size"):
        checkpointing.configure(object())


@pytest.mark.parametrize("section, message", [
    ({"contiguous_memory_optimization": True, "number_checkpoints": 2},
     "needs partition_activations"),
    ({"contiguous_memory_optimization": True, "partition_activations": True},
     "needs number_checkpoints"),
])
def test_contiguous_checkpointing_needs_what_deepspeed_requires(section, message):
    with pytest.raises(ConfigError, match=message) as info:
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": section})
    assert info.value.path == "activation_checkpointing.contiguous_memory_optimization"
    assert not checkpointing.is_configured()


@pytest.mark.parametrize("kwargs, path", [
    ({"checkpoint_in_cpu": 1}, "checkpoint_in_cpu"),
    ({"num_checkpoints": 0}, "num_checkpoints"),
    ({"profile": "yes"}, "profile"),
])
def test_configure_arguments_are_type_checked(kwargs, path):
    with pytest.raises(ConfigError) as info:
        checkpointing.configure(None, **kwargs)
    assert info.value.path == path


# --------------------------------------------------------------------------- the config key
def test_the_section_is_implemented_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZeroTrainConfigWarning)
        config = load_config({"train_batch_size": 8, "activation_checkpointing": SECTION},
                             world_size=2)
    assert config.activation_checkpointing.model_dump() == SECTION
    assert load_config({"train_batch_size": 8}, world_size=1).activation_checkpointing == \
        ActivationCheckpointingConfig()


@pytest.mark.parametrize("section, path, suggestion", [
    ({"partition_activation": True}, "activation_checkpointing.partition_activation",
     "did you mean partition_activations"),
    ({"cpu_checkpoint": True}, "activation_checkpointing.cpu_checkpoint",
     "did you mean cpu_checkpointing"),
    ({"number_checkpoints": "auto"}, "activation_checkpointing.number_checkpoints", None),
    ({"number_checkpoints": 0}, "activation_checkpointing.number_checkpoints", None),
    ({"profile": "true"}, "activation_checkpointing.profile", None),
    ("auto", "activation_checkpointing", None),
])
def test_bad_keys_and_values_name_the_dotted_path(section, path, suggestion):
    config = {"train_batch_size": 8, "activation_checkpointing": section}
    for load in (lambda: load_config(config, world_size=1),
                 lambda: load_activation_checkpointing(config),
                 lambda: checkpointing.configure(None, deepspeed_config=config)):
        with pytest.raises(ConfigError) as info:
            load()
        assert info.value.path == path
        if suggestion:
            assert info.value.suggestion == suggestion
