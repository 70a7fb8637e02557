"""Checkpoint pieces that need no process group: JSON values, names, manifest validation,
the resharding range arithmetic, the safetensors writer, the save directory, and the data
loader's resumable position."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:
    import zerotrain.checkpoint  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from safetensors.torch import load_file

from zerotrain.checkpoint import fs
from zerotrain.checkpoint.consolidate import parse_size, plan_shards
from zerotrain.checkpoint.manifest import (CheckpointError, check_tag, read_manifest,
                                           safe_file, to_json)
from zerotrain.checkpoint.reshard import source_pieces, target_range
from zerotrain.checkpoint.stfile import TensorSpec, write_file
from zerotrain.dataloader import DistributedLoader
from zerotrain.core.flat import FlatLayout


# --------------------------------------------------------------------------- JSON values
def test_to_json_names_the_key_path_of_a_non_json_value():
    with pytest.raises(CheckpointError, match=r"client_state\['a'\]\[1\]\['t'\] is a torch"):
        to_json({"a": [1, {"t": torch.zeros(1)}]}, "client_state")
    with pytest.raises(CheckpointError, match=r"client_state has the non-string key 3"):
        to_json({3: "x"}, "client_state")
    with pytest.raises(CheckpointError, match=r"client_state\['f'\] is a builtins.set"):
        to_json({"f": {1}}, "client_state")


def test_to_json_turns_tuples_into_lists_and_tensors_into_numbers_when_asked():
    import numpy
    value = {"betas": (0.9, 0.95), "lr": torch.tensor(0.5), "n": None, "ok": True,
             "k": numpy.int64(3)}
    assert to_json(value, "g", tensors_as_numbers=True) == {
        "betas": [0.9, 0.95], "lr": 0.5, "n": None, "ok": True, "k": 3}


# --------------------------------------------------------------------------- names
@pytest.mark.parametrize("tag", ["", ".", "..", "../up", "a/b", ".tmp-x", "latest", 3])
def test_tags_must_be_plain_directory_names(tag):
    with pytest.raises(CheckpointError):
        check_tag(tag)


def test_file_names_that_leave_the_checkpoint_directory_are_rejected(tmp_path):
    assert safe_file(str(tmp_path), "rank00000.safetensors", what="m").endswith("rank00000"
                                                                                 ".safetensors")
    os.symlink("/etc", tmp_path / "link")
    for name in ("../x", "/etc/passwd", "a/b", "..", "link/passwd", ""):
        with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
            safe_file(str(tmp_path), name, what="m")


def _minimal_manifest(tmp_path) -> dict:
    (tmp_path / "module.safetensors").write_bytes(b"12345")
    return {"format": "zerotrain.checkpoint", "version": 1, "tag": "t", "world_size": 1,
            "stage": 0, "precision": "fp32", "records": [],
            "counters": {"global_steps": 1, "micro_steps": 1, "skipped_steps": 0,
                         "global_samples": 8},
            "module_file": "module.safetensors", "frozen": [], "buffers": [],
            "rank_files": ["module.safetensors"], "file_sizes": {"module.safetensors": 5},
            "optimizer": {}}


def test_manifest_validation_catches_missing_fields_sizes_and_traversal(tmp_path):
    manifest = _minimal_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert read_manifest(str(tmp_path))["tag"] == "t"
    for edit, message in ((lambda m: m.pop("records"), "field 'records' is missing"),
                          (lambda m: m.update(version=2), "version 2"),
                          (lambda m: m["counters"].pop("micro_steps"), "counters.micro_steps"),
                          (lambda m: m["frozen"].append({"name": "x"}), "field 'key'"),
                          (lambda m: m["file_sizes"].update({"module.safetensors": 9}),
                           "truncated or corrupted"),
                          (lambda m: m.update(module_file="../module.safetensors"),
                           "outside the checkpoint directory")):
        broken = json.loads(json.dumps(manifest))
        edit(broken)
        (tmp_path / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match=message):
            read_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_manifest(str(tmp_path))


# --------------------------------------------------------------------------- resharding
def _shards(full: list[torch.Tensor], layout: FlatLayout) -> list[torch.Tensor]:
    shards = []
    for rank in range(layout.world):
        shard = torch.zeros(layout.shard_numel)
        for slot, param in zip(layout.slots, full):
            shard[layout.shard_slice(slot)] = layout.shard_of_full(param, slot, rank)
        shards.append(shard)
    return shards


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(numels=st.lists(st.integers(1, 40), min_size=1, max_size=6), source_world=st.integers(1, 5),
       target_world=st.integers(1, 5), source_bucket=st.integers(1, 100),
       target_bucket=st.integers(1, 100))
def test_target_shards_rebuilt_from_source_ranges_equal_direct_sharding(
        numels, source_world, target_world, source_bucket, target_bucket):
    full = [torch.arange(n, dtype=torch.float32) + 1000 * i for i, n in enumerate(numels)]
    source = FlatLayout(numels, world=source_world, bucket_numel=source_bucket)
    target = FlatLayout(numels, world=target_world, bucket_numel=target_bucket)
    source_shards = _shards(full, source)
    for rank, expected in enumerate(_shards(full, target)):
        rebuilt = torch.zeros(target.shard_numel)
        for t_slot, s_slot in zip(target.slots, source.slots):
            begin, end = target_range(target, t_slot, rank)
            at = target.shard_slice(t_slot).start
            for src_rank, lo, hi, offset in source_pieces(source, s_slot, begin, end):
                rebuilt[at + offset: at + offset + hi - lo] = source_shards[src_rank][lo:hi]
        assert torch.equal(rebuilt, expected)


# --------------------------------------------------------------------------- files
def test_the_streaming_writer_produces_files_safetensors_reads(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.tensor(2.5),
               "d": torch.randn(4).bfloat16(), "e": torch.zeros(0), "f": torch.ones(2).bool()}
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    path = str(tmp_path / "x.safetensors")
    size = write_file(path, specs, lambda s: tensors[s.key], metadata={"k": "v"})
    assert size == os.path.getsize(path)
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_shard_sizes_and_plan():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20
    assert parse_size(100) == 100 and parse_size("1.5KB") == 1500
    with pytest.raises(CheckpointError):
        parse_size("lots")
    specs = [TensorSpec(str(i), torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5])]
    plan = plan_shards(specs, 80)   # bytes: 40, 40, 120 (alone), 20
    assert [[s.key for s in shard] for shard in plan] == [["0", "1"], ["2"], ["3"]]


# --------------------------------------------------------------------------- save directory
def test_publish_replaces_a_tag_and_a_crash_between_renames_is_recovered(tmp_path):
    root = str(tmp_path)

    def save(tag, content, nonce):
        tmp = fs.prepare(root, tag, nonce)
        (Path(tmp) / "manifest.json").write_text(content)
        fs.publish(root, tmp, tag, nonce, save_latest=True)

    save("t1", "one", "aaa")
    save("t1", "two", "bbb")
    assert (tmp_path / "t1" / "manifest.json").read_text() == "two"
    assert fs.read_latest(root) == "t1" and sorted(os.listdir(root)) == ["latest", "t1"]
    # what a crash between moving t1 aside and moving the new one in leaves behind:
    os.rename(tmp_path / "t1", tmp_path / ".old-t1-ccc")
    os.makedirs(tmp_path / ".tmp-t1-ccc")
    assert fs.tag_dir(root, "t1") == str(tmp_path / ".old-t1-ccc")
    fs.prepare(root, "t2", "ddd")   # a save in progress holds its lock file
    assert sorted(os.listdir(root)) == [".tmp-t2-ddd", fs.LOCK_NAME, "latest", "t1"]
    fs.unlock(root)
    assert fs.tag_dir(root, "t1") == str(tmp_path / "t1")


# --------------------------------------------------------------------------- data position
def test_the_loader_resumes_mid_epoch_with_the_same_batches():
    data = torch.utils.data.TensorDataset(torch.arange(40.0))

    def loader():
        return DistributedLoader(data, micro_batch_size=3, rank=1, world_size=2)

    straight = loader()
    expected = [b[0].tolist() for _ in range(2) for b in straight]
    first = loader()
    it = iter(first)
    seen = [next(it)[0].tolist() for _ in range(4)]
    state = first.state_dict()
    assert state["epoch"] == 0 and state["batches_consumed"] == 4
    resumed = loader()
    pending = iter(resumed)          # created before the load, as RepeatingLoader does
    resumed.load_state_dict(state)
    seen += [b[0].tolist() for b in pending] + [b[0].tolist() for b in resumed]
    assert seen == expected and resumed.state_dict()["epoch"] == 2
