"""Hostile checkpoint state through a real load on 2 ranks: refused at staging (nothing
changed on any rank), one tag and one save for every rank, and auto-resume falling back
past a tag that cannot be loaded. File-level cases are in tests/unit/test_hostile_files.py.
"""
import json
import math
import os
import shutil
import sys

import pytest
import torch

import ds_fixture as F
import reference as R
from ds_fixture import M, MODEL, OPTIMS, TAG

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "unit"))

# DeepSpeed files: (name, edit of the optimizer groups or the model file, words the error names)
DEEPSPEED_CASES = {
    "lr_nan": ("group", {"lr": math.nan}, "param_groups[0].lr"),
    "lr_negative": ("group", {"lr": -100.0}, "param_groups[0].lr"),
    "decay_negative": ("group", {"weight_decay": -1.0}, "param_groups[0].weight_decay"),
    "lr_string": ("group", {"lr": "0.1"}, "param_groups[0].lr"),
    "betas_short": ("group", {"betas": [5]}, "param_groups[0].betas"),
    "scheduler_empty": ("model", {"lr_scheduler": {}}, "lr_scheduler lacks"),
    "scheduler_text": ("model", {"lr_scheduler": {"last_batch_iteration": "2"}},
                       "lr_scheduler['last_batch_iteration']"),
    "steps_huge": ("model", {"global_steps": 10 ** 30}, "global_steps"),
}


def _deepspeed_copies(base, monkeypatch) -> dict[str, str]:
    from test_deepspeed_files import _FakeDeepSpeed

    from zerotrain.checkpoint.deepspeed import load_file
    fake = _FakeDeepSpeed(monkeypatch)
    source = F.SAVE_DIR
    roots = {}
    for name, (kind, edit, _) in DEEPSPEED_CASES.items():
        root = base / name
        shutil.copytree(source, root)
        tag = root / TAG
        if kind == "model":
            data = load_file(str(tag / MODEL), mmap=False)
            data.update(edit)
            torch.save(data, tag / MODEL)
        else:
            for optim in OPTIMS:
                data = fake.unrecord(load_file(str(tag / optim), mmap=False))
                data["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0].update(
                    edit)
                torch.save(data, tag / optim)
        roots[name] = str(root)
    # auto-resume: the newest tag's scheduler state is {}, the next one cannot be listed
    fallback = base / "fallback"
    shutil.copytree(os.path.join(source, TAG), fallback / TAG)
    shutil.copytree(base / "scheduler_empty" / TAG, fallback / "global_step5")
    shutil.copytree(os.path.join(source, TAG), fallback / "global_step7")
    (fallback / "latest").write_text("global_step7")
    roots["fallback"] = str(fallback)
    return roots


def _deepspeed_job(rank, world, roots):
    from zerotrain.checkpoint import CheckpointError

    engine = F.build()
    F.first_step(engine, rank, world)
    before = F.snapshot(engine)
    out = {}
    for name in DEEPSPEED_CASES:
        try:
            engine.load_checkpoint(roots[name], tag=TAG)
            error = None
        except CheckpointError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - a raw error is what the test refuses
            error = f"raw {type(exc).__name__}: {exc}"
        out[name] = (error, F.same(before, F.snapshot(engine)))
    engine.close()
    listdir = os.listdir

    def unreadable(path):      # root reads any mode: the newest tag's listing fails instead
        if str(path).endswith("global_step7"):
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    os.listdir = unreadable
    try:
        resumed = F.build(checkpoint={"auto_resume": roots["fallback"]})
        out["fallback"] = (resumed.global_steps, resumed.get_lr()[0])
        resumed.close()
    except Exception as exc:  # noqa: BLE001
        out["fallback"] = f"{type(exc).__name__}: {exc}"
    finally:
        os.listdir = listdir
    return out


@pytest.mark.slow
def test_hostile_deepspeed_state_is_refused_at_staging_and_auto_resume_falls_back(
        worlds, tmp_path, monkeypatch):
    """DeepSpeed param_groups pass the zerotrain format's check; a scheduler state that
    would raise after the commit is refused before it; a too-large step count is refused;
    auto-resume skips the unlistable and the hostile tag and loads the good one."""
    roots = _deepspeed_copies(tmp_path, monkeypatch)
    monkeypatch.undo()
    for rank, res in enumerate(worlds.run(2, _deepspeed_job, roots)):
        for name, (_, _, words) in DEEPSPEED_CASES.items():
            error, unchanged = res[name]
            assert error is not None and not error.startswith("raw"), (rank, name, error)
            assert words in error, (name, error)
            assert unchanged, (rank, name)
        assert res["fallback"] == (M.BEFORE, pytest.approx(M.LR / 2)), res["fallback"]


# --------------------------------------------------------------------------- zerotrain format
# manifest edits: case -> (section, key, value); each is refused naming ``section[key]``
STATE_CASES = {"min_scale": ("loss_scaler", "min_scale", 1e30),
               "scale_factor": ("loss_scaler", "scale_factor", 0.5),
               "scale_window": ("loss_scaler", "scale_window", 0),
               "loss_scale_nan": ("loss_scaler", "loss_scale", math.nan),
               "loss_scale_zero": ("loss_scaler", "loss_scale", 0.0),
               "loss_scale_negative": ("loss_scaler", "loss_scale", -8.0),
               "loss_scale_inf": ("loss_scaler", "loss_scale", math.inf),
               "consumed_negative": ("data_loader", "batches_consumed", -3),
               "schedule_negative": ("lr_scheduler", "last_batch_iteration", -7)}
# Adam's per-parameter ``step`` in every record: each is refused naming the manifest
STEP_CASES = {"step_minus_one": -1.0, "step_fraction": -0.9, "step_half": 2.5}
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                           "warmup_num_steps": 4, "warmup_type": "linear"}}


def _edited(root: str, good: str, name: str, edit) -> str:
    shutil.copytree(os.path.join(root, good), os.path.join(root, name))
    path = os.path.join(root, name, "manifest.json")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    edit(manifest)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    return name


def _everything(engine) -> dict:
    """``F.snapshot`` (weights, masters, moments, steps, hyperparameters, lr, counters) and
    the scheduler's state and the random generators, bitwise."""
    import random
    state = F.snapshot(engine)
    state["scheduler"] = torch.tensor([float(v) for _, v in sorted(
        engine.lr_scheduler.state_dict().items())])
    state["rng.torch"] = torch.get_rng_state()
    state["rng.python"] = torch.tensor(random.getstate()[1])
    return state


def _zerotrain_job(rank, world, root):
    import torch.distributed as dist

    import zerotrain
    from zerotrain.checkpoint import CheckpointError, fs

    data = [R.micro_batch(i, 0, 0, size=1) for i in range(16)]   # its position is saved
    data = [(x[0], y[0]) for x, y in data]

    def build():
        model = R.make_model(0)
        cfg = R.engine_config(stage=2, precision="fp16", scheduler=SCHEDULE)
        return zerotrain.initialize(model=model, config=cfg, training_data=data)[0]

    engine = build()
    batches = iter(engine.training_dataloader)
    for step in range(2):
        engine.backward(engine(*next(batches)))
        engine.step()
        engine.save_checkpoint(root, tag=f"step{step + 1}")
    cases = {}
    if rank == 0:
        for name, (section, key, value) in STATE_CASES.items():
            cases[name] = _edited(root, "step2", f"state_{name}",
                                  lambda m, s=section, k=key, v=value: m[s].update({k: v}))
        cases["scheduler_empty"] = _edited(root, "step2", "sched",
                                           lambda m: m.update(lr_scheduler={}))
        cases["steps_huge"] = _edited(root, "step2", "huge",
                                      lambda m: m["counters"].update(global_steps=10 ** 30))
        for name, value in STEP_CASES.items():
            cases[name] = _edited(root, "step2", name, lambda m, v=value: [
                r["state_scalars"]["step"].update(value=v) for r in m["records"]])
    box = [cases if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    cases = box[0]
    before = _everything(engine)
    out = {}
    for what, tag in cases.items():
        try:
            engine.load_checkpoint(root, tag=tag)
            out[what] = (None, F.same(before, _everything(engine)))
        except CheckpointError as exc:
            out[what] = (str(exc), F.same(before, _everything(engine)))
        except Exception as exc:  # noqa: BLE001 - a raw error is what the test refuses
            out[what] = (f"raw {type(exc).__name__}: {exc}", F.same(before, _everything(engine)))
    # ``latest`` read at different times: rank 1 would see the older tag
    fresh = build()
    original = fs.read_latest_text
    if rank == 1:
        fs.read_latest_text = lambda save_dir: "step1"
    try:
        fresh.load_checkpoint(root)
    finally:
        fs.read_latest_text = original
    out["steps"] = fresh.global_steps
    # the tag re-saved between the ranks' reads: rank 1 reads all of the newer save
    tag_dir = fs.tag_dir
    if rank == 1:
        fs.tag_dir = lambda save_dir, tag: tag_dir(save_dir, "step2" if tag == "step1" else tag)
    try:
        fresh.load_checkpoint(root, tag="step1")
        out["resaved"] = None
    except CheckpointError as exc:
        out["resaved"] = str(exc)
    finally:
        fs.tag_dir = tag_dir
    fresh.close()
    engine.close()
    return out


@pytest.mark.slow
def test_hostile_zerotrain_state_is_refused_and_every_rank_loads_one_save(worlds, tmp_path):
    results = worlds.run(2, _zerotrain_job, str(tmp_path / "ckpt"))
    for rank, res in enumerate(results):
        for name, (section, key, _) in STATE_CASES.items():
            error, unchanged = res[name]   # the field and the tag's file are named
            assert error is not None and f"{section}[{key!r}]" in error, (rank, name, error)
            assert os.path.join(str(tmp_path / "ckpt"), f"state_{name}") in error, error
            assert unchanged, (rank, name)
        assert res["scheduler_empty"][0] is not None and "lr_scheduler lacks" in \
            res["scheduler_empty"][0] and res["scheduler_empty"][1]
        assert res["steps_huge"][0] is not None and "global_steps" in res["steps_huge"][0]
        for name in STEP_CASES:   # refused naming the file and the field, nothing changed
            error, unchanged = res[name]
            assert error is not None and not error.startswith("raw"), (rank, name, error)
            assert os.path.join(str(tmp_path / "ckpt"), name, "manifest.json") in error, error
            assert "optimizer state 'step'" in error and "non-negative integer" in error, error
            assert unchanged, (rank, name)
        assert res["steps"] == 2, res["steps"]             # rank 0 resolved ``latest``
        assert res["resaved"] is not None and "different saves" in res["resaved"]


# --------------------------------------------------------------------------- one rank only
ONE_RANK_CASES = ("fifo", "symlink_out", "pickle_bomb")


def _one_rank_copies(base) -> dict[str, str]:
    """The fixture tag as rank 0 sees it (``good``) and, per case, as rank 1 sees it with
    one hostile file (per-node copies of a checkpoint can differ)."""
    from test_hostile_files import BOMBS, _with_pickle
    roots = {"good": str(base / "good")}
    shutil.copytree(F.SAVE_DIR, roots["good"])
    for case in ONE_RANK_CASES:
        root = base / case
        shutil.copytree(F.SAVE_DIR, root)
        optim = root / TAG / OPTIMS[1]
        if case == "fifo":
            os.remove(optim)
            os.mkfifo(optim)
        elif case == "symlink_out":
            outside = base / "elsewhere" / case
            outside.mkdir(parents=True)
            shutil.move(str(optim), str(outside / OPTIMS[1]))
            os.symlink(outside / OPTIMS[1], optim)
        else:
            _with_pickle(str(root / TAG / MODEL), BOMBS["tuple_key"])
        roots[case] = str(root)
    return roots


def _one_rank_job(rank, world, roots):
    from zerotrain.checkpoint import CheckpointError

    engine = F.build()
    F.first_step(engine, rank, world)
    before = F.snapshot(engine)
    out = {}
    for case in ONE_RANK_CASES:
        try:
            engine.load_checkpoint(roots["good"] if rank == 0 else roots[case], tag=TAG)
            error = None
        except CheckpointError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - a raw error is what the test refuses
            error = f"raw {type(exc).__name__}: {exc}"
        out[case] = (error, F.same(before, F.snapshot(engine)))
    engine.load_checkpoint(roots["good"], tag=TAG)   # the group still works afterwards
    out["after"] = engine.global_steps
    engine.close()
    return out


@pytest.mark.slow
def test_a_file_only_one_rank_reads_badly_is_refused_on_every_rank(worlds, tmp_path):
    """Rank 1 alone meets a FIFO, a symlink out of the tag or a pickle bomb: its refusal
    goes through the load's agreement, so both ranks raise, neither hangs in a collective,
    and neither rank's state changes."""
    roots = _one_rank_copies(tmp_path)
    results = worlds.run(2, _one_rank_job, roots)
    for rank, res in enumerate(results):
        for case in ONE_RANK_CASES:
            error, unchanged = res[case]
            assert error is not None and not error.startswith("raw"), (rank, case, error)
            assert unchanged, (rank, case)
        assert res["after"] == M.BEFORE
    named = {"fifo": OPTIMS[1], "symlink_out": OPTIMS[1], "pickle_bomb": MODEL}
    for case, name in named.items():
        assert name in results[1][case][0], (case, results[1][case][0])
