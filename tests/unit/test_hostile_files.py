"""Hostile files never poison, stall or exhaust the process: each case is compared with
what ``torch.load(weights_only=True)`` does on the same bytes (where it refuses at once, so
must we). Run without a process group; the loads through an engine are in
tests/dist/test_hostile_state.py."""
import os
import shutil
import signal
import struct
import sys
import zipfile

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures"))
import make_deepspeed_ckpts as M  # noqa: E402

from zerotrain.checkpoint import CheckpointError, get_fp32_state_dict_from_zero_checkpoint
from zerotrain.checkpoint.deepspeed import DeepSpeedCheckpoint, load_file as ds_load
from zerotrain.checkpoint.fs import resume_candidates
from zerotrain.errors import ConfigError

TAG = f"global_step{M.BEFORE}"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


def _copy(tmp_path, case: str = "z2_fp32_w2") -> str:
    target = tmp_path / case
    shutil.copytree(os.path.join(M.DEFAULT_OUT, case, "checkpoint"), target)
    return str(target)


def _with_pickle(path: str, data_pkl: bytes, *, compression=zipfile.ZIP_STORED) -> None:
    """Rewrite torch.save archive ``path`` with ``data_pkl`` as its pickle."""
    with zipfile.ZipFile(path) as archive:
        entries = {info.filename: archive.read(info) for info in archive.infolist()}
    if data_pkl is not None:
        entries[next(n for n in entries if n.endswith("/data.pkl"))] = data_pkl
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


def _text(s: str) -> bytes:
    return b"X" + struct.pack("<I", len(s)) + s.encode()


@pytest.fixture
def alarm():
    """A blocked ``open`` or ``read`` raises instead of hanging the suite."""
    def timeout(*_):
        raise TimeoutError("blocked")
    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------- 1. BUILD
@pytest.mark.parametrize("refused_later", [False, True])
def test_a_build_on_an_allowed_function_is_refused_and_poisons_nothing(tmp_path, refused_later):
    """BUILD on torch._utils._rebuild_tensor_v2 would set attributes of the function for the
    whole process; torch's own weights-only unpickler refuses it, and so do we, with the
    allowlist of the read gone afterwards and later plain torch.loads correct."""
    target = torch._utils._rebuild_tensor_v2
    poison = (b"\x80\x02}" + _text("x") + b"ctorch._utils\n_rebuild_tensor_v2\n"
              + b"(N}" + _text("zerotrain_poisoned") + b"\x88st" + b"b" + b"s")
    if refused_later:
        poison += _text("y") + b"cposix\nsystem\n" + b"s"
    path = str(tmp_path / "x.pt")
    torch.save({"x": 0}, path)
    _with_pickle(path, poison + b".")
    before = set(torch.serialization.get_safe_globals())
    try:
        with pytest.raises(CheckpointError, match="x.pt"):
            ds_load(path)
        with pytest.raises(Exception, match="Can only build"):    # torch: the same refusal
            torch.load(path, weights_only=True)
        assert not hasattr(target, "zerotrain_poisoned")
    finally:
        if hasattr(target, "zerotrain_poisoned"):
            del target.zerotrain_poisoned
    assert set(torch.serialization.get_safe_globals()) == before   # nothing left allowlisted
    plain = str(tmp_path / "plain.pt")
    torch.save({"w": torch.arange(4.0)}, plain)
    assert torch.equal(torch.load(plain, weights_only=True)["w"], torch.arange(4.0))


def test_the_deepspeed_records_are_not_allowlisted_outside_a_read(tmp_path):
    ds_load(os.path.join(M.DEFAULT_OUT, "z2_fp32_w2", "checkpoint", TAG, OPTIM))
    names = [g[1] if isinstance(g, tuple) else g for g in torch.serialization.get_safe_globals()]
    assert not [n for n in names if "deepspeed" in str(n)]


# --------------------------------------------------------------------------- 4. deflate
def test_a_rezipped_deflated_optimizer_file_reads_its_true_values(tmp_path):
    """mmap of a compressed record would hand out compressed bytes as weights."""
    save_dir = _copy(tmp_path)
    for rank in (0, 1):
        _with_pickle(os.path.join(save_dir, TAG, f"zero_pp_rank_{rank}_mp_rank_00_optim_states"
                                  ".pt"), None, compression=zipfile.ZIP_DEFLATED)
    expected = load_file(os.path.join(M.DEFAULT_OUT, "z2_fp32_w2", "consolidated.safetensors"))
    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_a_zip_bomb_is_refused_before_inflating(tmp_path):
    path = str(tmp_path / "bomb.pt")
    torch.save({"x": torch.zeros(4)}, path)
    with zipfile.ZipFile(path) as archive:
        entries = {i.filename: archive.read(i) for i in archive.infolist()}
    entries["bomb/data/big"] = bytes(300 << 20)   # 300 MiB of zeros: ~300 KB deflated
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    with pytest.raises(CheckpointError, match="compressed records declare"):
        ds_load(path)


# --------------------------------------------------------------------------- 7, 9
def _model_file_with(tmp_path, **client) -> str:
    save_dir = _copy(tmp_path)
    path = os.path.join(save_dir, TAG, MODEL)
    data = ds_load(path, mmap=False)
    data.update(client)
    torch.save(data, path)
    return os.path.join(save_dir, TAG)


def test_nested_shared_lists_are_walked_once(tmp_path, alarm):
    nested = []
    for _ in range(60):
        nested = [nested, nested]
    tag = _model_file_with(tmp_path, nested=nested)
    torch.load(os.path.join(tag, MODEL), weights_only=True)   # torch: instant
    client = DeepSpeedCheckpoint(tag).client_state()
    assert client["nested"][0] is client["nested"][1]           # still shared, not copied


def test_a_stride_zero_client_tensor_is_refused_by_key(tmp_path):
    tag = _model_file_with(tmp_path, huge=torch.zeros(1).expand(2 ** 27))
    with pytest.raises(CheckpointError, match=r"client_state\['huge'\].*refusing to allocate"):
        DeepSpeedCheckpoint(tag).client_state()


def test_client_values_nested_too_deep_are_named(tmp_path):
    deep = 1
    for _ in range(150):
        deep = [deep]
    tag = _model_file_with(tmp_path, deep=deep)
    with pytest.raises(CheckpointError, match=r"client_state\['deep'\].*deeper"):
        DeepSpeedCheckpoint(tag).client_state()


# --------------------------------------------------------------------------- 8
@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_fifo_or_dev_zero_is_refused_everywhere_a_file_is_read(tmp_path, alarm, kind):
    def plant(path):
        if os.path.exists(path):
            os.remove(path)
        if kind == "fifo":
            os.mkfifo(path)
        else:
            os.symlink("/dev/zero", path)

    save_dir = _copy(tmp_path)
    plant(os.path.join(save_dir, TAG, OPTIM))
    with pytest.raises(CheckpointError, match="not a regular file"):
        DeepSpeedCheckpoint(os.path.join(save_dir, TAG))
    config = str(tmp_path / "ds_config.json")
    plant(config)
    from zerotrain.config import read_config_dict
    with pytest.raises(ConfigError, match="not a regular file"):
        read_config_dict(config)
    other = tmp_path / "other"
    (other / "older").mkdir(parents=True)
    plant(str(other / "older" / "manifest.json"))
    candidates, notes = resume_candidates(str(other))
    assert candidates == [] and "older" in notes[0]


# --------------------------------------------------------------------------- 10, 14
@pytest.mark.parametrize("field,value,named", [
    ("dp_world_size", "2", "dp_world_size"),
    ("global_steps", "3", "global_steps"),
    ("global_steps", 10 ** 30, "global_steps"),
    ("global_steps", -5, "global_steps"),
])
def test_wrong_model_fields_are_named_with_the_file(tmp_path, field, value, named):
    from zerotrain.checkpoint.match import check_counters
    tag = _model_file_with(tmp_path, **{field: value})
    with pytest.raises(CheckpointError, match=named) as info:
        ckpt = DeepSpeedCheckpoint(tag)
        check_counters(ckpt.counters(), ckpt.model_file)
    assert MODEL in str(info.value)


def test_a_flat_group_of_the_wrong_type_is_named(tmp_path, monkeypatch):
    from test_deepspeed_files import _FakeDeepSpeed
    fake = _FakeDeepSpeed(monkeypatch)
    save_dir = _copy(tmp_path)
    path = os.path.join(save_dir, TAG, OPTIM)
    original = fake.unrecord(ds_load(path, mmap=False))
    for flats in (7, [torch.zeros(2, 2)]):
        data = dict(original, optimizer_state_dict=dict(
            original["optimizer_state_dict"], single_partition_of_fp32_groups=flats))
        torch.save(data, path)
        with pytest.raises(CheckpointError, match="single_partition_of_fp32_groups") as info:
            DeepSpeedCheckpoint(os.path.join(save_dir, TAG))
        assert OPTIM in str(info.value)


def test_an_unknown_client_state_tag_names_the_checkpoint(tmp_path):
    from zerotrain.checkpoint import client_state
    with pytest.raises(CheckpointError, match="ckpt-dir"):
        client_state.load({"client_state": {"a": {"__zerotrain__": "pickle"}}}, "ckpt-dir")


def test_a_lock_holder_is_named_by_pid_even_while_it_writes(tmp_path):
    import fcntl
    from zerotrain.checkpoint import fs
    lock = tmp_path / fs.LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)     # holds the lock, has not written its pid yet
    try:
        with pytest.raises(CheckpointError) as info:
            fs.lock(str(tmp_path))
        assert "pid unknown" not in str(info.value)
    finally:
        os.close(fd)


@pytest.mark.parametrize("section,key,value", [
    ("loss_scaler", "loss_scale", 0.0), ("loss_scaler", "loss_scale", -8.0),
    ("loss_scaler", "loss_scale", float("nan")), ("loss_scaler", "loss_scale", float("inf")),
    ("data_loader", "batches_consumed", -3)])
def test_out_of_range_scaler_and_loader_state_is_refused_where_torch_load_takes_it(
        tmp_path, section, key, value):
    """``torch.load(weights_only=True)`` has no rule for these values and returns them as
    saved (a zero scale then divides by zero at the next step, a negative count crashes
    the loader's next pass); the checkpoint's check refuses them, naming field and file.
    The same edits through a real load on 2 ranks: tests/dist/test_hostile_state.py."""
    from zerotrain.checkpoint.match import check_data_loader, check_loss_scaler
    from zerotrain.core.precision import LossScaler

    live = {"loss_scaler": LossScaler(init_scale=2.0 ** 16, dynamic=True).state_dict(),
            "data_loader": {"epoch": 0, "batches_consumed": 2, "micro_batch_size": 4,
                            "world_size": 2}}[section]
    saved = dict(live, **{key: value})
    path = tmp_path / "state.pt"
    torch.save(saved, path)
    again = torch.load(path, weights_only=True)[key]
    assert again == value or (value != value and again != again)   # taken as it is
    check = {"loss_scaler": check_loss_scaler, "data_loader": check_data_loader}[section]
    where = f"checkpoint {tmp_path / 'tag'}"
    with pytest.raises(CheckpointError) as caught:
        check(saved, live, where)
    assert f"{section}[{key!r}]" in str(caught.value) and where in str(caught.value)
    assert saved[key] is value or saved[key] == value   # the check changed nothing
