"""DeepSpeed checkpoint files read without a process group: export, small state, and the
restricted unpickler (planted payloads in every file kind run nothing)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures"))
import make_deepspeed_ckpts as M  # noqa: E402

from zerotrain.checkpoint import CheckpointError, get_fp32_state_dict_from_zero_checkpoint
from zerotrain.checkpoint.deepspeed import DeepSpeedCheckpoint, find_tag_dir, load_file as ds_load
from zerotrain.checkpoint.full_weights import consolidate_main

CASES = [case.name for case in M.CASES]
FROZEN = {case.name: case.frozen for case in M.CASES}
TAG = f"global_step{M.BEFORE}"


def _tag_dir(case: str) -> str:
    return os.path.join(M.DEFAULT_OUT, case, "checkpoint", TAG)


# --------------------------------------------------------------------------- export
@pytest.mark.parametrize("case", CASES)
def test_consolidate_equals_deepspeeds_own_zero_to_fp32(tmp_path, case):
    """``consolidated.safetensors`` was written by DeepSpeed's zero_to_fp32 at fixture time."""
    expected = load_file(os.path.join(M.DEFAULT_OUT, case, "consolidated.safetensors"))
    out = tmp_path / "hf"
    assert consolidate_main([os.path.join(M.DEFAULT_OUT, case, "checkpoint"), str(out),
                             "--max-shard-size", "100B"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    ours = {}
    for name in sorted(set(index["weight_map"].values())):
        ours.update(load_file(str(out / name)))
    assert len(set(index["weight_map"].values())) > 1          # really sharded
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor.float()), name


def test_consolidate_to_one_file_and_from_the_tag_directory(tmp_path):
    target = tmp_path / "model.safetensors"
    assert consolidate_main([_tag_dir("z3_fp32_w3"), str(target)]) == 0
    expected = load_file(os.path.join(M.DEFAULT_OUT, "z3_fp32_w3", "consolidated.safetensors"))
    ours = load_file(str(target))
    assert all(torch.equal(ours[k], expected[k]) for k in expected)
    state = get_fp32_state_dict_from_zero_checkpoint(os.path.join(
        M.DEFAULT_OUT, "z3_fp32_w3", "checkpoint"), tag=TAG)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_consolidate_copies_the_hf_config_beside_latest(tmp_path):
    save_dir = tmp_path / "checkpoint-3"
    shutil.copytree(os.path.join(M.DEFAULT_OUT, "z2_fp32_w2", "checkpoint"), save_dir)
    (save_dir / "config.json").write_text(json.dumps({"model_type": "tiny", "hidden": 7}))
    assert consolidate_main([str(save_dir), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden"] == 7


def _files(folder) -> dict:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_consolidate_replaces_an_earlier_export_whole_and_never_half_writes(tmp_path,
                                                                           monkeypatch):
    """A re-export replaces the folder whole (no shard of the earlier one stays); a folder
    holding files an export does not write is refused; a failed export leaves the earlier
    output as it was and no temporary file; an output inside the source is refused."""
    from zerotrain.checkpoint import consolidate
    source = os.path.join(M.DEFAULT_OUT, "z2_fp32_w2", "checkpoint")
    out = tmp_path / "hf"
    assert consolidate_main([source, str(out), "--max-shard-size", "100B"]) == 0
    assert len(os.listdir(out)) > 3
    assert consolidate_main([source, str(out)]) == 0
    assert sorted(os.listdir(out)) == ["model-00001-of-00001.safetensors",
                                       "model.safetensors.index.json"]
    single = tmp_path / "model.safetensors"
    assert consolidate_main([source, str(single)]) == 0
    before, single_bytes = _files(out), single.read_bytes()
    writes = []
    real_write = consolidate.write_file

    def failing_write(path, *args, **kwargs):   # the disk fills up during the export
        writes.append(path)
        if len(writes) % 2 == 0:
            raise OSError(28, "No space left on device", path)
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(consolidate, "write_file", failing_write)
    assert consolidate_main([source, str(out), "--max-shard-size", "100B"]) == 1
    writes.append("-")     # the single file fails at its first write
    assert consolidate_main([source, str(single)]) == 1
    assert _files(out) == before and single.read_bytes() == single_bytes
    assert sorted(os.listdir(tmp_path)) == ["hf", "model.safetensors"]
    monkeypatch.setattr(consolidate, "write_file", real_write)
    (out / "tokenizer.json").write_text("{}")
    assert consolidate_main([source, str(out)]) == 1
    assert (out / "tokenizer.json").exists() and len(os.listdir(out)) == 3
    copy = _copy(tmp_path, "z2_fp32_w2")
    assert consolidate_main([copy, os.path.join(copy, TAG, "hf")]) == 1
    assert consolidate_main([copy, copy]) == 1
    assert not os.path.exists(os.path.join(copy, TAG, "hf"))


def test_without_optimizer_files_the_module_weights_are_exported(tmp_path):
    save_dir = _copy(tmp_path, "z2_fp32_w2")
    for rank in (0, 1):
        os.remove(os.path.join(save_dir, TAG, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    expected = load_file(os.path.join(M.DEFAULT_OUT, "z2_fp32_w2", "consolidated.safetensors"))
    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)   # fp32: module == masters
    stage3 = _copy(tmp_path, "z3_fp32_w3")
    for rank in (0, 1, 2):
        os.remove(os.path.join(stage3, TAG, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    with pytest.raises(CheckpointError, match="at stage 3 the module weights"):
        get_fp32_state_dict_from_zero_checkpoint(stage3)


# --------------------------------------------------------------------------- small state
@pytest.mark.parametrize("case", CASES)
def test_small_state_is_read(case):
    ckpt = DeepSpeedCheckpoint(_tag_dir(case))
    spec = json.load(open(os.path.join(M.DEFAULT_OUT, case, "case.json"), encoding="utf-8"))
    assert ckpt.world == spec["world"] and ckpt.stage == spec["stage"]
    assert ckpt.counters()["global_steps"] == M.BEFORE
    assert ckpt.counters()["global_samples"] == M.BEFORE * spec["world"] * spec["gas"] \
        * spec["micro"]
    assert ckpt.lr_scheduler_state() == {"last_batch_iteration": M.BEFORE - 1}
    client = ckpt.client_state()
    assert {k: v for k, v in client.items() if k != "counts"} == {
        k: v for k, v in M.CLIENT_STATE.items() if k != "counts"}
    assert torch.equal(client["counts"], M.CLIENT_STATE["counts"])
    assert [g["weight_decay"] for g in ckpt.hyperparameters()] == [0.1, 0.0]
    assert ckpt.loss_scaler_state() is None            # fp32/bf16: nothing for an fp16 scaler
    assert ckpt.buffer_names() == ["scale"]
    assert ckpt.frozen_names() == (["norm.weight", "norm.bias"] if FROZEN[case] else [])
    for name in ckpt.trainable_names():
        keys, step = ckpt.state_keys(name)
        assert sorted(keys) == ["exp_avg", "exp_avg_sq"] and step == M.BEFORE


def test_find_tag_dir_recognises_only_deepspeed(tmp_path):
    save_dir = os.path.join(M.DEFAULT_OUT, "z2_fp32_w2", "checkpoint")
    assert find_tag_dir(save_dir) == os.path.join(save_dir, TAG)
    assert find_tag_dir(save_dir, TAG) == os.path.join(save_dir, TAG)
    assert find_tag_dir(save_dir, "global_step9") is None
    assert find_tag_dir(str(tmp_path)) is None
    assert find_tag_dir(os.path.join(save_dir, TAG)) is None
    assert find_tag_dir(os.path.join(save_dir, TAG), accept_tag_dir=True) is not None


class _FakeDeepSpeed:
    """Stand-ins for DeepSpeed's classes, registered under DeepSpeed's module names, so a
    test can write a file that names them (as DeepSpeed does) without DeepSpeed."""

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch, self.classes, self.modules = monkeypatch, {}, set()

    def cls(self, qualname: str) -> type:
        if qualname not in self.classes:
            import types
            module, name = qualname.rsplit(".", 1)
            parts = module.split(".")
            for i in range(1, len(parts) + 1):
                dotted = ".".join(parts[:i])
                if dotted not in self.modules:
                    self.monkeypatch.setitem(sys.modules, dotted, types.ModuleType(dotted))
                    self.modules.add(dotted)
            made = type(name, (), {"__module__": module, "__qualname__": name,
                                   "__reduce__": lambda o: (type(o), o.args, o.state)})
            setattr(sys.modules[module], name, made)
            self.classes[qualname] = made
        return self.classes[qualname]

    def make(self, qualname: str, args: tuple = (), state=None):
        obj = object.__new__(self.cls(qualname))
        obj.args, obj.state = args, state
        return obj

    def unrecord(self, value):
        """A value read by zerotrain, with its DeepSpeed records turned back into objects."""
        if hasattr(value, "qualname") and hasattr(value, "attributes"):
            return self.make(value.qualname, value.args, value.state)
        if isinstance(value, dict):
            return type(value)((k, self.unrecord(v)) for k, v in value.items())
        if isinstance(value, list):
            return [self.unrecord(v) for v in value]
        return value


def test_fp16_loss_scaler_record_becomes_zerotrains_state(tmp_path, monkeypatch):
    """DeepSpeed's fp16 does not run on CPU, so its dynamic loss scaler is planted into a
    real optimizer-state file under DeepSpeed's own class name."""
    fake = _FakeDeepSpeed(monkeypatch)
    scaler = fake.make("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", (), dict(
        cur_scale=1024.0, cur_iter=7, last_overflow_iter=5, scale_factor=2.0,
        scale_window=100, min_scale=1.0, delayed_shift=2, cur_hysteresis=1,
        consecutive_hysteresis=False, dynamic=True))
    save_dir = _copy(tmp_path, "z2_fp32_w2")
    for rank in (0, 1):
        path = os.path.join(save_dir, TAG, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        data = fake.unrecord(ds_load(path, mmap=False))
        data["optimizer_state_dict"]["loss_scaler"] = scaler
        torch.save(data, path)
    monkeypatch.undo()          # reading must not need any deepspeed module
    state = DeepSpeedCheckpoint(os.path.join(save_dir, TAG)).loss_scaler_state()
    assert state == {"loss_scale": 1024.0, "dynamic": True, "scale_window": 100,
                     "hysteresis": 2, "cur_hysteresis": 1, "consecutive_hysteresis": False,
                     "min_scale": 1.0, "scale_factor": 2.0, "cur_iter": 7,
                     "last_overflow_iter": 5}


# --------------------------------------------------------------------------- bad files
def _copy(tmp_path, case: str) -> str:
    target = tmp_path / case
    shutil.copytree(os.path.join(M.DEFAULT_OUT, case, "checkpoint"), target)
    return str(target)


def test_missing_rank_file_is_named(tmp_path):
    save_dir = _copy(tmp_path, "z3_fp32_w3")
    os.remove(os.path.join(save_dir, TAG, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(CheckpointError, match="rank 1's file is missing"):
        DeepSpeedCheckpoint(os.path.join(save_dir, TAG))


def test_model_parallel_checkpoints_are_refused(tmp_path):
    save_dir = _copy(tmp_path, "z2_fp32_w2")
    shutil.copy(os.path.join(save_dir, TAG, "mp_rank_00_model_states.pt"),
                os.path.join(save_dir, TAG, "mp_rank_01_model_states.pt"))
    with pytest.raises(CheckpointError, match="model .tensor. parallel"):
        DeepSpeedCheckpoint(os.path.join(save_dir, TAG))


def test_truncated_file_is_named(tmp_path):
    save_dir = _copy(tmp_path, "z2_fp32_w2")
    path = os.path.join(save_dir, TAG, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        DeepSpeedCheckpoint(os.path.join(save_dir, TAG))


class _Payload:
    """Unpickling this runs ``os.system(command)``: what a malicious checkpoint carries."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


FILE_KINDS = [
    ("z2_fp32_w2", "mp_rank_00_model_states.pt"),
    ("z2_fp32_w2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("z1_bf16_w2", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("z3_fp32_w3", "zero_pp_rank_2_mp_rank_00_model_states.pt"),
    ("z3_fp32_w3", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
]


@pytest.mark.parametrize("case,filename", FILE_KINDS)
def test_planted_payload_runs_nothing(tmp_path, case, filename):
    """A real file with one value replaced by an os.system payload: refused by name."""
    save_dir = _copy(tmp_path, case)
    path = os.path.join(save_dir, TAG, filename)
    marker = tmp_path / "pwned"
    data = ds_load(path, mmap=False)
    key = "optimizer_state_dict" if "optim" in filename else "lr_scheduler"
    data[key] = {"harmless": 1, "nested": [_Payload(f"touch {marker}")]}
    torch.save(data, path)
    for attempt in (lambda: DeepSpeedCheckpoint(os.path.join(save_dir, TAG)),
                    lambda: get_fp32_state_dict_from_zero_checkpoint(save_dir)):
        with pytest.raises(CheckpointError) as info:
            attempt()
        assert "posix.system" in str(info.value) and filename in str(info.value)
    assert consolidate_main([save_dir, str(tmp_path / "out")]) == 1
    assert not marker.exists()


class EvilTensor(torch.Tensor):
    """A tensor subclass: its class is a global a pickle would have to import."""


def test_tensor_subclasses_are_refused(tmp_path):
    """``_rebuild_from_type_v2`` is allowed only for plain tensors and parameters."""
    path = str(tmp_path / "x.pt")
    torch.save({"t": torch.zeros(2).as_subclass(EvilTensor)}, path)
    with pytest.raises(CheckpointError, match="EvilTensor"):
        ds_load(path)


def test_torchscript_and_legacy_files_are_refused(tmp_path):
    scripted = str(tmp_path / "script.pt")
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), scripted)
    with pytest.raises(CheckpointError, match="TorchScript"):
        ds_load(scripted)
    legacy = str(tmp_path / "legacy.pt")
    torch.save({"a": 1}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="zip"):
        ds_load(legacy)


# --------------------------------------------------------------------------- regeneration
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="regenerating the fixtures needs DeepSpeed")
@pytest.mark.slow
def test_fixtures_regenerate_identically(tmp_path):
    for case in M.CASES:
        fresh = M.generate(case, str(tmp_path))
        for name in ("expected.safetensors", "consolidated.safetensors"):
            a = load_file(os.path.join(fresh, name))
            b = load_file(os.path.join(M.DEFAULT_OUT, case.name, name))
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), name
        _same_content(DeepSpeedCheckpoint(os.path.join(fresh, "checkpoint", TAG)),
                      DeepSpeedCheckpoint(_tag_dir(case.name)), case.name)


def _same_content(a: DeepSpeedCheckpoint, b: DeepSpeedCheckpoint, where: str) -> None:
    """Equal where it matters: DeepSpeed leaves its padding elements uninitialised."""
    assert a.trainable_names() == b.trainable_names(), where
    for name in a.trainable_names():
        numel = a.params[name].numel
        for key in ["master"] + a.state_keys(name)[0]:
            x, y = torch.empty(numel), torch.empty(numel)
            a.read_into(name, key, 0, numel, x)
            b.read_into(name, key, 0, numel, y)
            assert torch.equal(x, y), f"{where}: {name} {key}"
        assert a.state_keys(name) == b.state_keys(name), where
    for name in a.frozen_names() + a.buffer_names():
        assert torch.equal(a.module_tensor(name), b.module_tensor(name)), f"{where}: {name}"
    assert a.counters() == b.counters() and a.lr_scheduler_state() == b.lr_scheduler_state()
    assert a.hyperparameters() == b.hyperparameters(), where
    assert a.loss_scaler_state() == b.loss_scaler_state(), where
    ca, cb = a.client_state(), b.client_state()
    assert sorted(ca) == sorted(cb) and torch.equal(ca.pop("counts"), cb.pop("counts"))
    assert ca == cb, where


# --------------------------------------------------------------------------- memory
def _rss_anon() -> int:
    """Bytes of this process's anonymous memory (heap; not the mapped files' pages)."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("no RssAnon")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_consolidate_streams_one_parameter_at_a_time(tmp_path):
    """A bf16-optimizer layout of 5 x 8 MiB parameters on 2 ranks: while the whole model is
    written, anonymous memory grows by one or two parameters (the one being written and the
    next one read), far from the model (40 MiB) or a rank file (20 MiB)."""
    from collections import OrderedDict

    numel, world, count = 2 * 2**20, 2, 5
    shapes = OrderedDict((f"layer{i}.weight", torch.Size([numel])) for i in range(count))
    tag = tmp_path / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"module": OrderedDict(), "buffer_names": [], "param_shapes": [shapes],
                "dp_world_size": world, "global_steps": 1}, tag / "mp_rank_00_model_states.pt")
    (tag.parent / "latest").write_text("global_step1")
    full = torch.arange(count * numel, dtype=torch.float32)
    for rank, part in enumerate(full.chunk(world)):
        torch.save({"optimizer_state_dict": {"single_partition_of_fp32_groups": [part.clone()],
                                             "group_paddings": [0], "partition_count": [world],
                                             "base_optimizer_state": {"state": {}}}},
                   tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    del full, part
    # measured in a fresh process: this one's allocator still holds what built the files
    script = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_deepspeed_files import _rss_anon
from zerotrain.checkpoint import convert_zero_checkpoint_to_fp32_state_dict
from zerotrain.checkpoint.deepspeed import DeepSpeedExport
samples, read = [], DeepSpeedExport.read
def sampled(self, spec):
    tensor = read(self, spec)
    samples.append(_rss_anon())
    return tensor
DeepSpeedExport.read = sampled
before = _rss_anon()
convert_zero_checkpoint_to_fp32_state_dict({str(tag.parent)!r}, {str(tmp_path / "out")!r})
print(len(samples), max(samples) - before)
"""
    # A fixed mmap threshold: glibc otherwise raises it after the first large free, so later
    # 8 MiB tensors come from the heap and freed ones may stay resident; the growth then
    # counted one more parameter than is alive, now and then (24 MiB once in CI).
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072",
                                                PYTHONPATH=os.pathsep.join(
                                                    p for p in sys.path if p)))
    assert done.returncode == 0, done.stderr
    produced, growth = map(int, done.stdout.split()[-2:])
    print(f"anonymous memory grew by {growth / 2**20:.1f} MiB")
    assert produced == count
    assert growth < 2.5 * numel * 4, f"{growth / 2**20:.0f} MiB for 8 MiB parameters"
    out = load_file(str(tmp_path / "out" / "model-00001-of-00001.safetensors"))
    last = count * numel
    assert torch.equal(out[f"layer{count - 1}.weight"][-3:],
                       torch.arange(last - 3, last, dtype=torch.float32))


# --------------------------------------------------------------------------- file finders

def test_zero_to_fp32_file_finders_behave_as_deepspeeds(tmp_path):
    """``deepspeed.utils.zero_to_fp32``'s finders (Lightning imports them): DeepSpeed's
    names in natural order, its FileNotFoundError messages, the stage-3 model file."""
    from zerotrain.checkpoint.consolidate import (get_model_state_file, get_model_state_files,
                                                  get_optim_files)
    z3 = _tag_dir("z3_fp32_w3")
    assert [os.path.basename(f) for f in get_optim_files(z3)] == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)]
    assert get_model_state_file(z3, 3) == os.path.join(
        z3, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert len(get_model_state_files(z3)) == 3
    assert get_model_state_file(_tag_dir("z1_fp32_w2"), 1).endswith(
        os.sep + "mp_rank_00_model_states.pt")
    for rank in (10, 2, 1):   # natural order: 1, 2, 10
        (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert [os.path.basename(f).split("_")[3] for f in get_optim_files(str(tmp_path))] == [
        "1", "2", "10"]
    with pytest.raises(FileNotFoundError, match="doesn't exist"):
        get_model_state_file(str(tmp_path / "absent"), 3)
    with pytest.raises(FileNotFoundError, match="can't find model states file"):
        get_model_state_file(str(tmp_path), 2)
    with pytest.raises(FileNotFoundError, match=r"can't find \*_optim_states.pt files"):
        get_optim_files(str(tmp_path / "absent"))
