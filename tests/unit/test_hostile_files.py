"""Hostile files never poison, stall or exhaust the process: each case is compared with
what ``torch.load(weights_only=True)`` does on the same bytes (where it refuses at once, so
must we). Run without a process group; the loads through an engine are in
tests/dist/test_hostile_state.py."""
import ast
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
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
    for _ in range(15):   # 2**15 paths: within the pickle's work budget, walked once
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


@pytest.mark.parametrize("case", ["z1_fp32_w2", "z2_fp32_w2", "z3_fp32_w3"])
def test_a_flat_partition_of_the_wrong_length_is_named_with_its_file(tmp_path, monkeypatch,
                                                                     case):
    """Rank 1's flat partition two elements short: named with both files and the group, by
    the reader and by consolidation, before a bare tensor-size error could come up."""
    from test_deepspeed_files import _FakeDeepSpeed
    fake = _FakeDeepSpeed(monkeypatch)
    save_dir = _copy(tmp_path, case)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path = os.path.join(save_dir, TAG, name)
    data = fake.unrecord(ds_load(path, mmap=False))
    state = data["optimizer_state_dict"]
    key = "fp32_flat_groups" if "fp32_flat_groups" in state else \
        "single_partition_of_fp32_groups"
    state[key] = [t[:-2].clone() for t in state[key][:1]] + list(state[key][1:])
    torch.save(data, path)
    for read in (lambda: DeepSpeedCheckpoint(os.path.join(save_dir, TAG)),
                 lambda: get_fp32_state_dict_from_zero_checkpoint(save_dir)):
        with pytest.raises(CheckpointError, match=key) as info:
            read()
        assert name in str(info.value) and OPTIM in str(info.value), info.value
        assert "must match" not in str(info.value)


@pytest.mark.parametrize("field,value", [("base_optimizer_state", 7),
                                         ("base_optimizer_state", {"state": [1, 2]}),
                                         ("base_optimizer_state", {"state": {0: 3.0}})])
def test_a_base_optimizer_state_of_the_wrong_type_names_the_file_and_field(
        tmp_path, monkeypatch, field, value):
    from test_deepspeed_files import _FakeDeepSpeed
    fake = _FakeDeepSpeed(monkeypatch)
    save_dir = _copy(tmp_path, "z2_fp32_w2")
    path = os.path.join(save_dir, TAG, OPTIM)
    data = fake.unrecord(ds_load(path, mmap=False))
    data["optimizer_state_dict"][field] = value
    torch.save(data, path)
    with pytest.raises(CheckpointError, match=field) as info:
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


# --------------------------------------------------------------------------- every reader
# Every surface that reads a file from outside is one entry of READERS: ``build(tmp_path)``
# writes a valid input and returns the file a hostile hand replaces and how the surface
# reads it. A new reader adds one entry; each gets every planted kind below.
def _ds_tag(tmp_path, name: str):
    save_dir = _copy(tmp_path)
    tag = os.path.join(save_dir, TAG)
    return os.path.join(tag, name), lambda: DeepSpeedCheckpoint(tag)


def _ds_consolidate(tmp_path):
    save_dir = _copy(tmp_path)
    return (os.path.join(save_dir, TAG, MODEL),
            lambda: get_fp32_state_dict_from_zero_checkpoint(save_dir))


def _universal(tmp_path):
    from zerotrain.checkpoint.deepspeed.universal import UniversalCheckpoint
    target = tmp_path / "universal"
    shutil.copytree(os.path.join(UNIVERSAL, "global_step3_universal"), target)
    return (str(target / "zero" / "fc1.bias" / "fp32.pt"),
            lambda: UniversalCheckpoint(str(target))._tensor("fc1.bias", "master"))


def _dcp(tmp_path, chunk: bool):
    from test_dcp_files import _model, _write_dcp
    from zerotrain.checkpoint.dcp import DcpCheckpoint
    folder = tmp_path / "dcp"
    _write_dcp(str(folder))
    name = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0] if chunk \
        else ".metadata"

    def read():
        ckpt = DcpCheckpoint(str(folder), _model())
        return [ckpt.full(n, "master") for n in ckpt.trainable_names()]
    return str(folder / name), read


def _model_config(tmp_path):
    from zerotrain.estimate.models import shape_from_hf_config
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2,
                                "vocab_size": 16, "n_positions": 8}))
    return str(path), lambda: shape_from_hf_config(str(path))


def _planner_config(tmp_path):
    from zerotrain.planner.spec import _hf_config
    path, _ = _model_config(tmp_path)
    return path, lambda: _hf_config(path)


def _hf_weights(tmp_path):
    from safetensors.torch import save_file
    from zerotrain.integrations.hf_weights import load_checkpoint_gathered
    folder = tmp_path / "hf"
    folder.mkdir()
    model = torch.nn.Linear(3, 2)
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    path = str(folder / "model.safetensors")
    return path, lambda: load_checkpoint_gathered(torch.nn.Linear(3, 2), [path])


def _ds_config(tmp_path):
    from zerotrain.config import read_config_dict
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 8}')
    return str(path), lambda: read_config_dict(str(path))


def _latest(tmp_path):
    from zerotrain.checkpoint.fs import read_latest
    (tmp_path / "latest").write_text(TAG)
    return str(tmp_path / "latest"), lambda: read_latest(str(tmp_path))


UNIVERSAL = os.path.join(os.path.dirname(M.DEFAULT_OUT), "deepspeed_universal", "z2_fp32_w2")
READERS = {
    "deepspeed_optim": (lambda t: _ds_tag(t, OPTIM), CheckpointError),
    "deepspeed_model": (lambda t: _ds_tag(t, MODEL), CheckpointError),
    "deepspeed_consolidate": (_ds_consolidate, CheckpointError),
    "deepspeed_universal": (_universal, CheckpointError),
    "dcp_chunk": (lambda t: _dcp(t, chunk=True), CheckpointError),
    "dcp_metadata": (lambda t: _dcp(t, chunk=False), CheckpointError),
    "estimate_model_config": (_model_config, ValueError),
    "planner_model_config": (_planner_config, ValueError),
    "hf_weights": (_hf_weights, ConfigError),
    "ds_config": (_ds_config, ConfigError),   # named by the user: no folder to stay in
    "latest": (_latest, CheckpointError),
}
_NO_FOLDER = {"ds_config"}   # a file the user names directly may link anywhere
REFUSAL = r"not a regular file|outside the folder"


def _plant(path: str, kind: str, outside: str) -> None:
    """Replace ``path`` by a FIFO, a link to /dev/zero, or a link to a valid copy of
    itself outside its folder (``outside``) or inside it (the one kind that must load)."""
    if kind in ("symlink_out", "symlink_within"):
        target = outside if kind == "symlink_out" else path + ".real"
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.move(path, target)
        os.symlink(target if kind == "symlink_out" else os.path.basename(target), path)
        return
    os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "symlink_out", "symlink_within"])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_refuses_a_planted_file_by_name(tmp_path, alarm, monkeypatch, reader,
                                                     kind):
    """A FIFO would block the reader for ever, /dev/zero never ends, a symlink out of the
    folder turns any file the job can read into weights; a symlink within it is fine."""
    monkeypatch.chdir(tmp_path)
    build, error = READERS[reader]
    (tmp_path / "in").mkdir()
    path, read = build(tmp_path / "in")
    _plant(path, kind, str(tmp_path / "elsewhere" / os.path.basename(path)))
    if kind == "symlink_within" or (kind == "symlink_out" and reader in _NO_FOLDER):
        read()
        return
    with pytest.raises(error, match=REFUSAL) as info:
        read()
    assert os.path.basename(path) in str(info.value)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "symlink_out"])
def test_a_planted_manifest_is_no_resume_candidate(tmp_path, alarm, kind):
    (tmp_path / "ckpt" / "older").mkdir(parents=True)
    path = tmp_path / "ckpt" / "older" / "manifest.json"
    path.write_text('{"counters": {"global_steps": 3}}')
    _plant(str(path), kind, str(tmp_path / "elsewhere" / "manifest.json"))
    candidates, notes = resume_candidates(str(tmp_path / "ckpt"))
    assert candidates == [] and "older" in notes[0]


# --------------------------------------------------------------------------- one opener
# Reading a file any other way than through zerotrain.untrusted (or, for pickles, the one
# bounded unpickler in checkpoint/restricted.py) is refused below. Writers that save are
# allowed by name: each opens a file it creates (or a directory to fsync), never one it reads.
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src",
                    "zerotrain")
ALLOWED_OPENS = {
    ("checkpoint/restricted.py", "check_torch_archive"): "zip index of an opened file object",
    ("checkpoint/restricted.py", "load_torch"): "torch.load after the pickle pre-scan",
    ("checkpoint/restricted.py", "_Unpickler"): "the restricted unpickler itself",
    ("checkpoint/stfile.py", "write_file"): "writes a new safetensors file",
    ("checkpoint/stfile.py", "fsync_path"): "opens a file or directory to fsync it",
    ("checkpoint/fs.py", "lock"): "creates the save lock file",
    ("checkpoint/fs.py", "write_latest"): "writes a new 'latest' beside the old one",
    ("checkpoint/save.py", "_write_json"): "writes a new JSON file",
    ("checkpoint/consolidate.py", "_write_json"): "writes the safetensors index",
    ("checkpoint/writer.py", "write_marker"): "writes this rank's marker",
    ("checkpoint/writer.py", "mark_failed"): "creates this rank's empty failure mark",
    ("checkpoint/recovery.py", "write_script"): "writes zero_to_fp32.py aside",
    ("checkpoint/deepspeed/module_file.py", "write_module_file"): "fsyncs the file it wrote",
}
_READ_ATTRS = {"open", "read_bytes", "read_text", "fdopen", "from_file", "fromfile", "memmap",
               "mmap", "safe_open", "load_file", "Unpickler"}
_READ_CALLS = {("json", "load"), ("torch", "load"), ("np", "load"), ("numpy", "load"),
               ("pickle", "load"), ("pickle", "loads"), ("zipfile", "ZipFile"),
               ("tarfile", "open")}


def _dotted(node) -> list:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _opens(path: str) -> list[tuple[str, int, str]]:
    """(enclosing function or class, line, what) for each way of reading a file."""
    found, scope = [], []

    class Visit(ast.NodeVisitor):
        def visit_FunctionDef(self, node):
            scope.append(node.name)
            self.generic_visit(node)
            scope.pop()

        visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

        def _hit(self, node, what):
            found.append((scope[-1] if scope else "<module>", node.lineno, what))

        def visit_ImportFrom(self, node):
            names = {a.name for a in node.names}
            if (node.module or "").split(".")[0] in ("safetensors", "pickle", "mmap", "numpy") \
                    and names & (_READ_ATTRS | {"load", "loads"}):
                self._hit(node, f"from {node.module} import {sorted(names)}")

        def visit_Call(self, node):
            parts = _dotted(node.func)
            if parts and parts[0] != "untrusted" and (
                    parts in (["open"], ["safe_open"]) or tuple(parts[-2:]) in _READ_CALLS
                    or (len(parts) >= 2 and parts[-1] in _READ_ATTRS)
                    or parts[-2:] == ["os", "open"] or parts[-2:] == ["io", "open"]):
                self._hit(node, ".".join(parts))
            self.generic_visit(node)

        def visit_Attribute(self, node):   # a base class such as pickle.Unpickler
            if node.attr in ("Unpickler",) and isinstance(node.ctx, ast.Load):
                self._hit(node, ".".join(_dotted(node)))
            self.generic_visit(node)

    with open(path, encoding="utf-8") as f:
        Visit().visit(ast.parse(f.read()))
    return found


def test_every_file_is_read_through_the_one_opener():
    """No module of the checkpoint, planner or estimate packages opens a file another way
    (open, Path.read_bytes, torch.load, safe_open, json.load, np.load, mmap, zipfile, ...)
    outside the opener, the bounded unpickler and the named writers."""
    stray, used = [], set()
    for package in ("checkpoint", "planner", "estimate"):
        for folder, _, files in os.walk(os.path.join(_SRC, package)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                module = os.path.relpath(path, _SRC).replace(os.sep, "/")
                for scope, line, what in _opens(path):
                    if (module, scope) in ALLOWED_OPENS:
                        used.add((module, scope))
                    else:
                        stray.append(f"{module}:{line} ({scope}) {what}")
    assert not stray, "files opened around zerotrain.untrusted:\n" + "\n".join(stray)
    assert used == set(ALLOWED_OPENS), f"allowlist entries no longer needed: " \
                                       f"{sorted(set(ALLOWED_OPENS) - used)}"


def test_the_scan_sees_each_way_of_opening(tmp_path):
    """The scan above would catch each of these (so it cannot pass by seeing nothing)."""
    sample = tmp_path / "sample.py"
    sample.write_text("import json, torch, numpy as np, mmap\n"
                      "from safetensors import safe_open\n"
                      "def f(p):\n"
                      "    open(p); p.read_bytes(); p.read_text(); p.open()\n"
                      "    torch.load(p); safe_open(p, 'pt'); json.load(p); np.load(p)\n"
                      "    mmap.mmap(0, 1); untrusted.read_json(p)\n")
    whats = [what for _, _, what in _opens(str(sample))]
    assert len(whats) == 10, whats   # every line but the opener's own call


# --------------------------------------------------------------------------- pickle bombs
def _tuple_chain(levels: int) -> bytes:
    """Level i is ``(level i-1, level i-1)``, its second half fetched from the memo: three
    bytes per level, 2**levels tuples to hash. Opcodes torch's weights-only unpickler takes."""
    out = b")q\x00"                                     # EMPTY_TUPLE, BINPUT 0
    for i in range(1, levels + 1):
        out += b"h" + bytes([i - 1]) + b"\x86q" + bytes([i])   # BINGET, TUPLE2, BINPUT
    return out


def _list_chain(levels: int) -> bytes:
    """Lists level i = ``[level i-1, level i-1]`` from the memo, every level left on the
    stack (torch's unpickler has no POP): close with a MARK-taking opcode."""
    out = b"]q\x00"                                     # EMPTY_LIST, BINPUT 0
    for i in range(1, levels + 1):
        out += b"]q" + bytes([i]) + b"(h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"e"
    return out


BOMBS = {
    # a memo-shared nested tuple used as a dict key: hashing it never ends
    "tuple_key": b"\x80\x02}" + _tuple_chain(60) + b"Ns.",
    # shared lists handed to torch.serialization._get_layout, which printed its argument
    "layout_list": b"\x80\x02ctorch.serialization\n_get_layout\nq\xc8" + _list_chain(60)
                   + b"h\xc8h\x3c\x85R.",   # _get_layout(level 60)
    # a tuple nested 100000 deep used as a dict key
    "deep_key": b"\x80\x02}N" + b"\x85" * 100_000 + b"Ns.",
}
_CHILD = """
import sys
from zerotrain.checkpoint import CheckpointError
{setup}
for name, target in {targets!r}:
    try:
        {call}
        print(name, "LOADED", flush=True)
    except CheckpointError as exc:
        print(name, "REFUSED", str(exc).replace(chr(10), " "), flush=True)
"""


def _run_bounded(setup: str, call: str, targets: list) -> dict:
    """Run the reads in a child process: a regression that spins (in C, where no signal
    reaches Python) fails here on the timeout instead of hanging the suite."""
    code = _CHILD.format(setup=setup, targets=targets, call=call)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still reading after 240 s: {call}")
    assert done.returncode == 0, done.stderr[-2000:]
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1]
            for line in done.stdout.splitlines() if line}


@pytest.mark.slow
def test_pickle_bombs_in_a_dcp_metadata_are_refused(tmp_path):
    targets = []
    for name, data in BOMBS.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / ".metadata").write_bytes(data)
        targets.append((name, str(folder)))
    result = _run_bounded("from zerotrain.checkpoint.dcp.metadata import read_metadata",
                          "read_metadata(target)", targets)
    for name, folder in targets:
        assert result[name].startswith("REFUSED"), (name, result[name])
        assert ".metadata" in result[name] and "pickle" in result[name], result[name]


@pytest.mark.slow
def test_pickle_bombs_in_a_deepspeed_model_file_are_refused_by_load_and_consolidate(
        tmp_path):
    """torch's weights-only unpickler takes each of these; the pre-scan of ``data.pkl``
    inside the zip refuses them before ``torch.load`` runs."""
    bombs = {"tuple_key": BOMBS["tuple_key"], "deep_key": BOMBS["deep_key"]}
    nested = b"\x80\x02}X\x06\x00\x00\x00nestedq\xff(" + _list_chain(60) + b"ts."
    bombs["shared_lists"] = nested   # a client_state list shared 2**60 ways
    targets = []
    for name, data in bombs.items():
        save_dir = _copy(tmp_path / name)
        _with_pickle(os.path.join(save_dir, TAG, MODEL), data)
        targets.append((name, save_dir))
    setup = ("from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint\n"
             "from zerotrain.checkpoint.deepspeed import DeepSpeedCheckpoint\n"
             "import os")
    loaded = _run_bounded(setup, f"DeepSpeedCheckpoint(os.path.join(target, {TAG!r}))",
                          targets)
    consolidated = _run_bounded(setup, "get_fp32_state_dict_from_zero_checkpoint(target)",
                                targets)
    for result in (loaded, consolidated):
        for name, _ in targets:
            assert result[name].startswith("REFUSED"), (name, result[name])
            assert MODEL in result[name] and "pickle" in result[name], result[name]


def test_get_layout_accepts_only_a_string(tmp_path):
    from zerotrain.checkpoint.dcp.metadata import ALLOWED
    from zerotrain.checkpoint.restricted import restricted_loads
    data = b"\x80\x02ctorch.serialization\n_get_layout\n(X\x01\x00\x00\x00xl\x85R."
    with pytest.raises(CheckpointError, match=r"x\.metadata"):
        restricted_loads(data, ALLOWED, path="x.metadata", what="DCP .metadata")
    good = b"\x80\x02ctorch.serialization\n_get_layout\nX\r\x00\x00\x00torch.strided\x85R."
    assert restricted_loads(good, ALLOWED, path="x", what="x") == "torch.strided"


@pytest.mark.parametrize("case", ["ops", "memo_miss", "truncated", "depth", "shared"])
def test_the_pickle_scan_bounds_each_kind_of_work(case):
    """Each budget of the pre-scan on its own, on pickles a real save never writes."""
    from zerotrain.checkpoint.restricted import MAX_DEPTH, UnsafePickle, scan_pickle
    data, budget = {
        "ops": (b"\x80\x02" + b"N0" * 2000 + b"N.", {"max_ops": 1000}),
        "memo_miss": (b"\x80\x02h\x07.", {}),
        "truncated": (b"\x80\x02X\xff\xff\xff\x7fabc.", {}),
        "depth": (b"\x80\x02N" + b"\x85" * (MAX_DEPTH + 1) + b".", {}),
        "shared": (b"\x80\x02(" + _list_chain(30) + b"t.", {}),
    }[case]
    with pytest.raises(UnsafePickle):
        scan_pickle(data, **budget)
    scan_pickle(pickle.dumps({"a": [(1, 2)] * 1000, "b": list(range(10_000))}))   # fine
