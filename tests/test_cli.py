"""Tests for the ``zerotrain`` command: estimate's table and errors, the subcommand list, and
the pass-through of ``launch`` and ``consolidate``."""
from __future__ import annotations

import json
from dataclasses import replace
import subprocess
import sys
import types

import pytest

from zerotrain.cli import main
from zerotrain.config import load_config


@pytest.mark.slow
def test_estimate_prints_the_zero_table_through_the_installed_module():
    done = subprocess.run([sys.executable, "-m", "zerotrain.cli", "estimate", "--params", "7B",
                           "--gpus", "8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for label, total in [("data parallel (stage 0)", "112"), ("ZeRO-1", "38.5"),
                         ("ZeRO-2", "26.25"), ("ZeRO-3", "14")]:
        assert any(line.startswith(label + " ") and f" {total} " in line for line in lines)
    assert "come on top" in done.stdout


def test_estimate_with_gpu_memory_recommends_and_writes_a_loadable_config(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    assert main(["estimate", "--params", "7B", "--gpus", "8", "--gpu-memory", "80GB",
                 "--write", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Recommendation: ZeRO-2" in out and "ds_config.json:" in out
    config = load_config(str(path), world_size=8)
    assert config.zero_optimization.stage == 2 and config.precision == "bf16"
    assert json.loads(path.read_text())["zero_optimization"]["stage"] == 2


def test_estimate_from_a_hf_config_adds_activations(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
                                "n_embd": 768, "n_layer": 12, "n_head": 12}))
    assert main(["estimate", "--model", str(path), "--gpus", "2", "--micro-batch", "8",
                 "--seq-len", "1024", "--gpu-memory", "24GB"]) == 0
    out = capsys.readouterr().out
    assert "124.44M parameters" in out and "Activations per GPU (micro-batch 8 x 1024" in out
    assert "need*" in out and "Recommendation:" in out


@pytest.mark.parametrize("argv, flag", [
    (["--params", "7X"], "--params"),
    (["--params", "7B", "--gpu-memory", "80"], "--gpu-memory"),
    (["--params", "7B", "--cpu-memory", "lots"], "--cpu-memory"),
    (["--params", "7B", "--gpus", "0"], "--gpus"),
    (["--params", "7B", "--micro-batch", "4"], "--micro-batch"),
    (["--params", "7B", "--write", "x.json"], "--write"),
    (["--model", "no_such_file.json"], "--model"),
    # sane bounds, checked before any work (1e9 GPUs exhausted memory; the others were
    # tracebacks)
    (["--params", "7B", "--gpus", "1000000000"], "--gpus"),
    (["--params", "7B", "--gpus", "1024", "--nodes", "1024"], "--gpus/--nodes"),
    (["--params", "1e308T"], "--params"),
    (["--params", "7B", "--gpu-memory", "1e300TiB"], "--gpu-memory"),
    (["--params", "7B", "--gpu-memory", "80GB", "--write", "no_such_folder/x.json"],
     "--write"),
])
def test_bad_estimate_arguments_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "zerotrain estimate: error: argument " + flag in err


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("estimate", "demo", "launch", "consolidate"):
        assert command in out


def test_launch_forwards_everything_to_torchrun(monkeypatch):
    import torch.distributed.run

    seen = []
    monkeypatch.setattr(torch.distributed.run, "main", lambda argv: seen.append(argv))
    assert main(["launch", "--nproc_per_node", "2", "train.py", "--steps", "3"]) == 0
    assert seen == [["--nproc_per_node", "2", "train.py", "--steps", "3"]]


def test_consolidate_calls_export_consolidate_main(monkeypatch):
    seen = []
    fake = types.ModuleType("zerotrain.checkpoint.full_weights")
    fake.consolidate_main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "zerotrain.checkpoint.full_weights", fake)
    assert main(["consolidate", "ckpt", "out", "--tag", "t", "--max-shard-size", "5GB"]) == 0
    assert seen == [["ckpt", "out", "--tag", "t", "--max-shard-size", "5GB"]]


def test_consolidate_without_export_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "zerotrain.checkpoint.full_weights", None)  # makes the import fail
    assert main(["consolidate", "ckpt", "out"]) == 2
    assert "zerotrain consolidate: not available" in capsys.readouterr().err


# ------------------------------------------------------------------ the traced step
_TINY = __import__("os").path.join(__import__("os").path.dirname(__file__), "fixtures",
                                   "configs", "gpt2-tiny.json")


def test_estimate_traces_one_step_and_prints_the_peak_as_json(capsys):
    from zerotrain.planner import StepSpec, plan_peak

    assert main(["estimate", "--model", _TINY, "--micro-batch", "2", "--seq-len", "32",
                 "--gpus", "2", "--stage", "1", "--dtype", "fp32", "--backend", "gloo",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    expected = plan_peak(StepSpec(_TINY, micro_batch=2, seq_len=32, gpus=2, stage=1,
                                  dtype="fp32", backend="gloo"))
    assert got["peak_bytes_per_rank"] == expected.peak_bytes > 0
    assert got["backend"] == "gloo"
    assert got["peak_host_bytes_per_node"] == 0
    assert got["peak_at"] in ("forward", "backward", "step")
    # the breakdown is what was alive at the peak: it adds up to it
    assert sum(got["breakdown"].values()) == got["peak_bytes_per_rank"]
    assert {"parameters", "optimizer_state"} <= set(got["breakdown"])


def test_estimate_fit_writes_a_config_that_loads(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    assert main(["estimate", "--model", _TINY, "--micro-batch", "2", "--seq-len", "32",
                 "--gpus", "2", "--dtype", "fp32", "--fit", "100MB",
                 "--write", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Fits 100.00 MB per GPU: stage 0, micro-batch 2 x 1")
    config = load_config(json.loads(path.read_text()), world_size=2)
    assert config.zero_optimization.stage == 0


@pytest.mark.parametrize("argv, needle", [
    (["--params", "7B", "--stage", "3"], "needs --model"),
    (["--model", _TINY, "--stage", "3", "--micro-batch", "2"], "--micro-batch/--seq-len"),
    (["--model", _TINY, "--json", "--micro-batch", "2", "--seq-len", "8", "--write", "x"],
     "--write"),
])
def test_estimate_trace_errors_name_the_option(argv, needle, capsys):
    with pytest.raises(SystemExit):
        main(["estimate", *argv])
    assert needle in capsys.readouterr().err


def _config(tmp_path, **fields):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 256, "n_positions": 64,
                                "n_embd": 64, "n_layer": 2, "n_head": 4, **fields}))
    return str(path)


@pytest.mark.parametrize("trace", [[], ["--stage", "3"]])
@pytest.mark.parametrize("value", [4e9, 4_000_000_000, 64.5, "64", True])
def test_a_model_dimension_out_of_bounds_is_one_line_naming_it(tmp_path, capsys, trace, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", _config(tmp_path, n_embd=value), "--micro-batch", "1",
              "--seq-len", "8", *trace])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("zerotrain estimate: error: argument --model: model config n_embd")


@pytest.mark.parametrize("trace", [[], ["--stage", "3", "--json"]])
def test_a_sequence_longer_than_the_models_positions_is_refused(tmp_path, capsys, trace):
    """GPT-2's learned positions: 65 tokens on a 64-position model raise IndexError in the
    real step; the estimate and the trace (fake tensors look nothing up) refuse it."""
    model = _config(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", model, "--micro-batch", "1", "--seq-len", "65", *trace])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --seq-len: 65 tokens are more than the model's 64 positions" in err
    assert "n_positions" in err
    assert main(["estimate", "--model", model, "--micro-batch", "1", "--seq-len", "64",
                 *trace]) == 0


def test_the_planner_refuses_a_sequence_beyond_a_learned_position_table(tmp_path):
    """A BERT config (counted without positions) is refused by the traced step itself, from
    the model's position table."""
    from zerotrain.estimate.models import SequenceLengthError
    from zerotrain.planner import StepSpec, plan_peak

    path = tmp_path / "bert.json"
    path.write_text(json.dumps({"model_type": "bert", "vocab_size": 128, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "max_position_embeddings": 16}))
    with pytest.raises(SequenceLengthError, match="17 tokens are more than the model's 16 "
                       "positions .*position_embeddings"):
        plan_peak(StepSpec(str(path), micro_batch=1, seq_len=17, stage=1, dtype="fp32"))


def test_write_into_a_missing_folder_is_refused_before_the_trace(monkeypatch, capsys):
    import zerotrain.planner as planner

    def never(*args, **kwargs):
        raise AssertionError("traced before checking --write")
    monkeypatch.setattr(planner, "fit", never)
    monkeypatch.setattr(planner, "plan_peak", never)
    with pytest.raises(SystemExit):
        main(["estimate", "--model", _TINY, "--micro-batch", "2", "--seq-len", "32",
              "--fit", "1GB", "--write", "no_such_folder/ds_config.json"])
    assert "argument --write: the folder" in capsys.readouterr().err


def _llama_config(tmp_path, **fields):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
                                "intermediate_size": 32, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2,
                                **fields}))
    return str(path)


@pytest.mark.parametrize("argv, words", [
    (["--params", "7B", "--gpus", "6", "--tp", "4"], "--tp: 4 does not divide the 6 GPUs"),
    (["--params", "7B", "--tp", "0"], "--tp"),
    (["--params", "7B", "--tp", "2000000"], "--tp"),
    (["MODEL", "--gpus", "4", "--tp", "4"],
     "--tp: tensor-parallel size 4 does not divide the model's num_key_value_heads (2)"),
])
def test_estimate_tensor_parallel_errors_are_one_line_naming_the_option(tmp_path, argv, words,
                                                                         capsys):
    argv = [a if a != "MODEL" else "--model" for a in argv]
    if "--model" in argv:
        argv.insert(argv.index("--model") + 1, _llama_config(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("zerotrain estimate: error: argument --tp") and words in err[-1]


def test_estimate_tensor_parallel_formula_uses_the_model_split(tmp_path, capsys):
    assert main(["estimate", "--model", _llama_config(tmp_path), "--gpus", "4", "--tp", "2",
                 "--micro-batch", "2", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "Ψ_s = 4,608 (split by the AutoTP rules)" in out and "D = N/T = 2" in out


def test_estimate_traces_a_tensor_parallel_step(tmp_path, capsys):
    assert main(["estimate", "--model", _llama_config(tmp_path), "--gpus", "4", "--tp", "2",
                 "--micro-batch", "2", "--seq-len", "16", "--dtype", "fp32",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["tensor_parallel_size"], out["stage"], out["world_size"]) == (2, 3, 4)
    assert out["peak_bytes_per_rank"] > 0


def test_estimate_fit_with_tensor_parallelism_picks_stage_3_where_only_it_fits(tmp_path,
                                                                             capsys):
    from zerotrain.planner import StepSpec, plan_peak

    model = _llama_config(tmp_path)
    spec = StepSpec(model, micro_batch=1, seq_len=16, gpus=4, dtype="fp32", tp=2)
    budget = plan_peak(replace(spec, stage=3)).device_bytes
    assert plan_peak(replace(spec, stage=2)).device_bytes > budget   # stage 2 does not fit
    assert main(["estimate", "--model", model, "--gpus", "4", "--tp", "2", "--micro-batch",
                 "1", "--seq-len", "16", "--dtype", "fp32", "--fit", f"{budget}B",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["stage"], out["offload"], out["tensor_parallel_size"]) == (3, "none", 2)
    assert out["activation_checkpointing"] is False


def test_estimate_traces_stage_3_with_tensor_parallelism(tmp_path, capsys):
    """Stage 3 partitions each rank's slices over its data-parallel group: the traced peak
    of T=2 x D=2 lies below the untouched model's on the same 4 GPUs."""
    peaks = {}
    for tp in (1, 2):
        assert main(["estimate", "--model", _llama_config(tmp_path), "--gpus", "4",
                     "--tp", str(tp), "--stage", "3", "--micro-batch", "2", "--seq-len", "16",
                     "--dtype", "fp32", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["tensor_parallel_size"], out["stage"], out["world_size"]) == (tp, 3, 4)
        peaks[tp] = out["peak_bytes_per_rank"]
    assert 0 < peaks[2] < peaks[1]


def test_a_fake_world_leaves_no_subgroup_of_its_own_behind():
    """A later fake world may reuse the id() of this one's default group, the key of the
    subgroup cache: a group left cached would be one torch has destroyed."""
    from zerotrain.comm import Communicator
    from zerotrain.comm.communicator import _SUBGROUPS
    from zerotrain.planner.fake_world import fake_world

    before = dict(_SUBGROUPS)
    with fake_world(0, 4, "gloo"):
        Communicator().subgroup([[0, 2], [1, 3]])
        assert len(_SUBGROUPS) == len(before) + 1
    assert _SUBGROUPS == before
