"""DeepSpeed names used the way DeepSpeed scripts use them, without a process group:
argument parsing, the accelerator, the ops optimizers, out-of-scope features, client_state
encoding and ``python -m zerotrain``."""
from __future__ import annotations

import argparse
import random
import runpy
import sys

import numpy as np
import pytest
import torch

import zerotrain
from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint import client_state as cs
from zerotrain.errors import ConfigError


# --------------------------------------------------------------------------- arguments
def test_add_config_arguments_matches_deepspeed_and_leaves_local_rank_to_the_script():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser = zerotrain.add_config_arguments(parser)   # no "conflicting option string"
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json",
                              "--local_rank=1"])
    assert (args.deepspeed, args.deepspeed_config, args.local_rank) == (True, "ds.json", 1)
    assert (args.deepscale, args.deepscale_config) == (False, None)
    added = {a.dest for a in parser._actions} - {"help", "local_rank"}
    assert added == {"deepspeed", "deepspeed_config", "deepscale", "deepscale_config"}
    alone = zerotrain.add_config_arguments(argparse.ArgumentParser()).parse_args([])
    assert not hasattr(alone, "local_rank")


# --------------------------------------------------------------------------- accelerator
def test_cpu_accelerator_answers_like_deepspeeds(monkeypatch):
    from zerotrain.accelerator import Accelerator

    acc = Accelerator("cpu")
    acc.set_device(3)   # a no-op on the CPU, as in DeepSpeed
    assert acc.device_name() == acc.device_name(1) == acc.current_device_name() == "cpu"
    assert acc.is_available() and acc.device_count() == 1
    assert acc.communication_backend_name() == "gloo"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert acc.current_device() == 1
    acc.synchronize()
    acc.empty_cache()
    used = acc.memory_allocated()
    assert 0 < used <= acc.max_memory_allocated() and used < acc.total_memory()
    acc.manual_seed(7)
    first = torch.rand(3)
    acc.manual_seed(7)
    assert torch.equal(first, torch.rand(3))
    assert torch.float16 not in acc.supported_dtypes() and not acc.is_fp16_supported()
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'"):
        Accelerator("xpu")
    assert zerotrain.get_accelerator() is zerotrain.accelerator.get_accelerator()


# --------------------------------------------------------------------------- ops
@pytest.mark.parametrize("cls", ["FusedAdam", "DeepSpeedCPUAdam"])
@pytest.mark.parametrize("decoupled", [True, False])
def test_ops_adam_is_torch_adam_with_deepspeeds_arguments(cls, decoupled):
    from zerotrain.ops import adam

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    twin = torch.nn.Linear(5, 3)
    twin.load_state_dict(model.state_dict())
    mode = "adam_w_mode" if cls == "FusedAdam" else "adamw_mode"
    ours = getattr(adam, cls)(model.parameters(), lr=1e-2, betas=(0.8, 0.99),
                              weight_decay=0.1, **{mode: decoupled})
    ref_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = ref_cls(twin.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    for step in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, ours), (twin, ref)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-6), (cls, decoupled)
    with pytest.raises(ValueError, match="bias_correction=False"):
        getattr(adam, cls)(model.parameters(), bias_correction=False)


def test_cpu_adam_keeps_moments_in_the_dtype_it_steps():
    """``fp32_optimizer_states=False`` (DeepSpeed: moments in the parameter dtype) is torch's
    Adam's own behaviour; the flag is kept for the engine's check beside
    ``bf16.bf16_optimizer_states``."""
    from zerotrain.ops.adam import DeepSpeedCPUAdam

    model = torch.nn.Linear(2, 2).bfloat16()
    opt = DeepSpeedCPUAdam(model.parameters(), fp32_optimizer_states=False)
    model(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    assert not opt.fp32_optimizer_states
    assert {v.dtype for s in opt.state.values() for v in s.values() if v.dim()} == {
        torch.bfloat16}


# --------------------------------------------------------------------------- out of scope
def test_pipeline_names_import_and_refuse_when_used_and_moe_refuses_expert_parallelism():
    from zerotrain.moe.layer import MoE
    from zerotrain.pipe import LayerSpec, PipelineModule
    from zerotrain.unsupported import UnsupportedFeatureError

    class MyMoE(MoE):   # subclassing at import time works, as scripts do
        pass

    cases = [(lambda: MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2,
                          ep_size=2), "ep_size=2"),
             (lambda: MyMoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=4), "ep_size=4"),
             (lambda: PipelineModule(layers=[LayerSpec(torch.nn.Linear, 2, 2)]),
              "pipeline parallelism")]
    for call, named in cases:
        with pytest.raises(UnsupportedFeatureError, match=named):
            call()
    with pytest.raises(ConfigError, match="MoE.ep_size"):
        MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=3, ep_size=2)
    assert zerotrain.moe.layer.MoE.__name__ == "MoE"   # reachable from `import zerotrain`


# --------------------------------------------------------------------------- client_state
def test_client_state_round_trips_tensors_arrays_rng_states_and_namespaces():
    import json

    value = {"step": 6, "t": torch.arange(6.0).view(2, 3), "half": torch.ones(2).half(),
             "arr": np.arange(4, dtype=np.uint32) * 1_000_000_000, "flag": np.bool_(True),
             "python_rng": random.getstate(), "numpy_rng": np.random.get_state(),
             "torch_rng": torch.get_rng_state(), "args": argparse.Namespace(lr=0.1, tags=[1]),
             "pair": (1, "a"), "nested": [{"x": np.float32(1.5)}]}
    expected = (random.random(), np.random.rand(), torch.rand(1))  # drawn from those states
    encoded, tensors = cs.encode(value)
    back = cs.decode(json.loads(json.dumps(encoded)), tensors.__getitem__)
    assert back["step"] == 6 and back["pair"] == (1, "a") and back["nested"] == [{"x": 1.5}]
    assert torch.equal(back["t"], value["t"]) and back["half"].dtype == torch.float16
    assert back["arr"].dtype == np.uint32 and (back["arr"] == value["arr"]).all()
    assert back["flag"] is True and back["args"] == value["args"]
    random.setstate(back["python_rng"])
    np.random.set_state(back["numpy_rng"])
    torch.set_rng_state(back["torch_rng"])
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])


@pytest.mark.parametrize("bad, key", [
    ({"fn": len}, "client_state['fn']"),
    ({"a": [1, {"obj": object()}]}, "client_state['a'][1]['obj']"),
    ({"__zerotrain__": 1}, "client_state"),
    ({"s": np.array(["x"])}, "client_state['s']"),
    ({"c": torch.zeros(2, dtype=torch.complex64)}, "client_state['c']"),
])
def test_client_state_refusals_name_the_key_and_what_is_supported(bad, key):
    with pytest.raises(CheckpointError) as info:
        cs.encode(bad)
    message = str(info.value)
    assert key in message, message
    assert "never pickle" in message or "reserves" in message or "dtype" in message


# --------------------------------------------------------------------------- __main__
def test_python_dash_m_zerotrain_runs_the_command(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["zerotrain", "estimate", "--params", "1B"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("zerotrain", run_name="__main__", alter_sys=True)
    assert info.value.code == 0
    assert "1B parameters" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["--standalone", "--nproc_per_node", "2", "--as-deepspeed", "train.py", "--lr", "1"],
     ["--standalone", "--nproc_per_node", "2", "-m", "zerotrain.as_deepspeed", "train.py",
      "--lr", "1"]),
    (["--as-deepspeed", "--no_local_rank", "--nnodes", "1", "-m", "pkg.train", "--y"],
     ["--nnodes", "1", "-m", "zerotrain.as_deepspeed", "--no_local_rank", "-m", "pkg.train",
      "--y"]),
    (["--as-deepspeed", "t.py", "--no_local_rank"],   # after the script: the script's own
     ["-m", "zerotrain.as_deepspeed", "t.py", "--no_local_rank"]),
    (["t.py", "--as-deepspeed"], ["t.py", "--as-deepspeed"]),
])
def test_launch_as_deepspeed_runs_the_script_through_the_switch(argv, expected):
    from zerotrain.launch import _as_deepspeed

    assert _as_deepspeed(argv) == expected


# --------------------------------------------------------------------------- comm
@pytest.mark.parametrize("name, args", [
    ("all_gather_object", ([None], 1)), ("broadcast_object_list", ([1], 0)),
    ("gather", (torch.zeros(1),)), ("scatter", (torch.zeros(1),)),
    ("send", (torch.zeros(1), 1)), ("recv", (torch.zeros(1), 0)),
    ("isend", (torch.zeros(1), 1)), ("irecv", (torch.zeros(1), 0)),
    ("monitored_barrier", ()), ("get_all_ranks_from_group", ()),
    ("reduce_scatter", (torch.zeros(1), [torch.zeros(1)])),
    ("all_to_all", ([torch.zeros(1)], [torch.zeros(1)])),
    ("all_reduce_coalesced", ([torch.zeros(1)],)),
    ("all_gather_coalesced", ([torch.zeros(1)], [torch.zeros(1)])),
    ("reduce_scatter_fn", (torch.zeros(1), torch.zeros(1))),
    ("allgather_fn", (torch.zeros(1), torch.zeros(1))),
    ("inference_all_reduce", (torch.zeros(1),)),
])
def test_comm_functions_without_a_process_group_say_what_to_call(name, args):
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert zerotrain.comm.is_available() is dist.is_available()
    with pytest.raises(RuntimeError, match=r"comm\.\w+\(\) needs the process group: call "
                                           r"zerotrain\.init_distributed\(\)"):
        getattr(zerotrain.comm, name)(*args)


# --------------------------------------------------------------------------- partition_parameters
def test_partition_parameters_handles_and_released_shape_answer_as_deepspeeds():
    from zerotrain.stages.zero3.partition import empty_placeholder
    from zerotrain.zero.partition_parameters import (MultipleAllGatherHandles,
                                                     partitioned_param_data_shape)

    class Positional:
        def wait(self, handle_dependency=True):
            self.seen = handle_dependency

    class KeywordOnly:
        def wait(self, *, handle_dependency=True):
            self.seen = handle_dependency

    class Kwargs:
        def wait(self, **kwargs):
            self.seen = kwargs

    handles = [Positional(), KeywordOnly(), Kwargs()]
    MultipleAllGatherHandles(handles).wait(handle_dependency=False)
    assert [h.seen for h in handles] == [False, False, {"handle_dependency": False}]
    released = empty_placeholder(torch.nn.Parameter(torch.ones(3, 6)))
    assert released.shape == torch.Size(partitioned_param_data_shape)
