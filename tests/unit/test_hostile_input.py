"""Hostile input gets a named error, never a RecursionError, OverflowError or TypeError."""
import json

import pytest

from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.manifest import read_manifest
from zerotrain.checkpoint.stfile import TensorSpec, write_file
from zerotrain.config import load_config
from zerotrain.errors import ConfigError


def test_a_config_nested_too_deep_or_with_huge_numbers_is_a_config_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    digits = tmp_path / "digits.json"
    digits.write_text('{"train_batch_size": ' + "9" * 5000 + "}")
    nested: dict = {"train_batch_size": 8}
    inner = nested
    for _ in range(10_000):
        inner["a"] = {}
        inner = inner["a"]
    for config in (str(deep), str(digits), nested):
        with pytest.raises(ConfigError):
            load_config(config, world_size=1)


def test_a_huge_batch_size_given_as_a_python_number_is_named():
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps"):
        config = {"train_batch_size": 8, key: 10 ** 5000}
        with pytest.raises(ConfigError, match=f"{key}.*about 500[01] digits"):
            load_config(config, world_size=1)
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config({"train_batch_size": 2 ** 31}, world_size=1)


def test_an_infinite_comms_timeout_is_named_before_the_group_exists():
    from zerotrain.engine.build import _comms_timeout
    with pytest.raises(ConfigError, match="comms_timeout"):
        load_config({"train_batch_size": 8, "comms_timeout": float("inf")}, world_size=1)
    assert _comms_timeout({"comms_timeout": float("inf")}) is None   # no OverflowError
    assert _comms_timeout({}) is None
    assert _comms_timeout({"comms_timeout": 4}).total_seconds() == 4


def test_a_full_disk_error_names_the_file_being_written():
    import torch
    with pytest.raises(CheckpointError, match="/dev/full"):
        write_file("/dev/full", [TensorSpec("x", torch.float32, (1 << 16,))],
                   lambda spec: torch.zeros(spec.shape))


def _manifest_with_a_record(tmp_path) -> dict:
    (tmp_path / "module.safetensors").write_bytes(b"12345")
    record = {"key": "rec0", "group_index": 0, "names": ["w"], "shapes": [[2]],
              "layout": {"world": 1, "numels": [2], "bucket_numel": 2}, "shard_numel": 2,
              "files": ["module.safetensors"], "dtype": "F32", "state_tensors": [],
              "state_scalars": {"step": {"dtype": "F32", "value": 3.0}}}
    return {"format": "zerotrain.checkpoint", "version": 1, "tag": "t", "world_size": 1,
            "stage": 0, "precision": "fp32", "records": [record],
            "counters": {"global_steps": 1, "micro_steps": 1, "skipped_steps": 0,
                         "global_samples": 8},
            "module_file": "module.safetensors", "frozen": [], "buffers": [],
            "rank_files": ["module.safetensors"], "file_sizes": {"module.safetensors": 5},
            "optimizer": {}}


@pytest.mark.parametrize("edit", ["deep", "scalar_type", "scalar_huge"])
def test_a_manifest_with_hostile_values_is_a_checkpoint_error(tmp_path, edit):
    manifest = _manifest_with_a_record(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert read_manifest(str(tmp_path))["records"][0]["key"] == "rec0"
    tag_dir = tmp_path
    record = manifest["records"][0]
    if edit == "deep":
        text = '{"a":' * 100_000 + "1" + "}" * 100_000
    else:
        record["state_scalars"] = {"step": 3} if edit == "scalar_type" else {
            "step": {"dtype": "F32", "value": 10 ** 400}}
        text = json.dumps(manifest)
    (tag_dir / "manifest.json").write_text(text)
    with pytest.raises(CheckpointError):
        read_manifest(str(tag_dir))


def test_consolidating_a_record_bigger_than_its_file_fails_before_allocating(tmp_path):
    """A manifest claiming a 10^11-element parameter over a 4-element shard file: a named
    error, not a 400 GB allocation."""
    import torch
    from zerotrain.checkpoint import iter_fp32_tensors
    from zerotrain.core.flat import FlatLayout
    tag = tmp_path / "t"
    tag.mkdir()
    (tmp_path / "latest").write_text("t")
    sizes = {"rank00000.safetensors": write_file(
        str(tag / "rank00000.safetensors"), [TensorSpec("rec0/master", torch.float32, (4,))],
        lambda spec: torch.ones(4)),
        "module.safetensors": write_file(str(tag / "module.safetensors"), [],
                                         lambda spec: None)}
    numel = 10 ** 11
    layout = FlatLayout([numel], world=1, bucket_numel=numel)
    record = {"key": "rec0", "group_index": 0, "names": ["w"], "shapes": [[numel]],
              "layout": layout.describe(), "shard_numel": layout.shard_numel,
              "files": ["rank00000.safetensors"], "dtype": "F32", "state_tensors": [],
              "state_scalars": {}}
    manifest = {"format": "zerotrain.checkpoint", "version": 1, "tag": "t", "world_size": 1,
                "stage": 0, "precision": "fp32", "records": [record],
                "counters": {"global_steps": 1, "micro_steps": 1, "skipped_steps": 0,
                             "global_samples": 8},
                "module_file": "module.safetensors", "frozen": [], "buffers": [],
                "rank_files": ["rank00000.safetensors"], "file_sizes": sizes,
                "optimizer": {}}
    (tag / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="shape"):
        next(iter(iter_fp32_tensors(str(tmp_path))))


def test_a_safetensors_header_too_large_to_be_a_checkpoints_is_refused_unparsed(tmp_path):
    import struct
    from zerotrain.checkpoint.stfile import MAX_HEADER_BYTES, Reader
    (tmp_path / "rank00000.safetensors").write_bytes(
        struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{" + b" " * 64)
    with Reader(str(tmp_path)) as reader:
        with pytest.raises(CheckpointError, match="declares a header of"):
            reader.handle("rank00000.safetensors")
