"""Checkpoints: exact resume, N -> M resharding across stages, atomicity, export, errors.

Each test runs a grid of cases inside one call on long-lived ranks (``worlds``); only the
crash tests start fresh processes (``run_world``), because the saving process kills itself.
Save directories live under pytest's ``tmp_path``, shared by all ranks of one machine.
"""
import json
import os
import pickle
import shutil

import pytest
import torch
from torch import nn

import reference as R
from distributed import run_world

BEFORE, AFTER = 3, 2          # optimizer steps before the save and after the load
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                           "warmup_num_steps": 4, "warmup_type": "linear"}}


# --------------------------------------------------------------------------- helpers
def _train(engine, rank, *, ga, first, steps):
    for step in range(first, first + steps):
        for micro in range(ga):
            engine.backward(engine(*R.micro_batch(step, rank, micro)))
            engine.step()


def _params(model):
    import zerotrain
    with zerotrain.zero.GatheredParameters(list(model.parameters())):  # stage 3: full values
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _engine(config, seed=0, model=None, **kwargs):
    import zerotrain
    model = model if model is not None else R.make_model(seed)
    engine, _, loader, _ = zerotrain.initialize(model=model, config=config, **kwargs)
    return engine, model, loader


class _Config:
    def to_dict(self):
        return {"model_type": "tiny", "hidden_size": 29}


class ExtrasNet(R.TinyNet):
    """TinyNet plus what is not a trainable parameter: buffers (one int, one not
    persistent), a frozen parameter, and a Hugging Face style ``config``."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        super().__init__()
        self.register_buffer("running", torch.arange(5, dtype=torch.float32) + seed)
        self.register_buffer("count", torch.tensor(7 + seed))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)
        self.config = _Config()

    def forward(self, x, y):
        return super().forward(x, y) + 0.0 * (self.frozen.sum() + self.running.sum())


class WiderNet(R.TinyNet):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__()
        self.hidden = nn.Linear(13, 30)
        self.out = nn.Linear(30, R.OUT)


# --------------------------------------------------------------------------- exact resume
RESUME_CASES = [  # stage, precision, ga, clip, overlap
    (0, "fp32", 2, 0.5, False), (1, "fp32", 1, 0.0, True), (2, "fp32", 2, 0.5, False),
    (2, "bf16", 2, 0.0, True), (1, "fp16", 1, 0.0, False), (3, "fp32", 2, 0.5, True),
    (3, "bf16", 1, 0.0, False)]


def _resume_grid(rank, world, root, cases):
    out = []
    for stage, precision, ga, clip, overlap in cases:
        cfg = R.engine_config(stage=stage, ga=ga, clip=clip, overlap=overlap,
                              precision=precision, scheduler=SCHEDULE)
        straight, model, _ = _engine(cfg)
        _train(straight, rank, ga=ga, first=0, steps=BEFORE + AFTER)
        first, _, _ = _engine(cfg)
        _train(first, rank, ga=ga, first=0, steps=BEFORE)
        save_dir = os.path.join(root, f"resume{stage}{precision}")
        first.save_checkpoint(save_dir, client_state={"note": [1, 2.5, None]})
        saved = first.last_checkpoint_report
        resumed, resumed_model, _ = _engine(cfg, seed=1)   # different initial weights
        path, client = resumed.load_checkpoint(save_dir)
        counters = (resumed.global_steps, resumed.micro_steps, resumed.get_lr())
        _train(resumed, rank, ga=ga, first=BEFORE, steps=AFTER)
        out.append({"case": (stage, precision, ga), "client": client, "path": path,
                    "diff": R.max_diff(_params(model), _params(resumed_model)),
                    "lr": (straight.get_lr(), resumed.get_lr()), "counters": counters,
                    "scale": (straight.loss_scale, resumed.loss_scale),
                    "saved_bytes": saved.bytes_written, "save_s": saved.seconds,
                    "load_s": resumed.last_checkpoint_report.seconds,
                    "read": resumed.last_checkpoint_report.elements_read})
    out.append(_resume_with_data(rank, root))
    return out


def _resume_with_data(rank, root):
    """training_data given: the resumed run sees the same batches in the same order."""
    import zerotrain
    data = torch.utils.data.TensorDataset(torch.randn(48, R.IN), torch.randn(48, R.OUT))
    cfg = R.engine_config(stage=1, ga=2)

    def run(steps, *, load_from=None, save_to=None, seed=0):
        engine, model, loader = _engine(cfg, seed=seed, training_data=data)
        batches = iter(zerotrain.RepeatingLoader(loader))  # created before the load
        if load_from:
            engine.load_checkpoint(load_from)
        seen = []
        for _ in range(steps * 2):
            x, y = next(batches)
            seen.append(float(x.sum()))
            engine.backward(engine(x, y))
            engine.step()
        if save_to:
            engine.save_checkpoint(save_to)
        return _params(model), seen

    full, seen_full = run(5)      # 6 batches per epoch per rank: crosses into epoch 1
    save_dir = os.path.join(root, "resume_data")
    run(2, save_to=save_dir)
    resumed, seen_resumed = run(3, load_from=save_dir, seed=1)
    return {"case": "data", "diff": R.max_diff(full, resumed),
            "order": seen_full[4:] == seen_resumed}


def test_resume_is_bit_identical_at_every_stage_and_precision(worlds, tmp_path):
    per_rank = worlds.run(2, _resume_grid, str(tmp_path), RESUME_CASES)
    numel = sum(p.numel() for p in R.make_model().parameters())
    for rank, results in enumerate(per_rank):
        for res in results[:-1]:
            where = f"rank {rank} {res['case']}"
            assert res["diff"] == 0.0, where
            assert res["lr"][0] == res["lr"][1] and res["scale"][0] == res["scale"][1], where
            stage, _, ga = res["case"]
            assert res["counters"][:2] == (BEFORE, BEFORE * ga), where
            assert res["client"] == {"note": [1, 2.5, None]}, where
            assert res["path"].endswith(f"global_step{BEFORE}"), where
            # master + exp_avg + exp_avg_sq: all of them at stage 0, about half when sharded
            if stage == 0:
                assert res["read"] == 3 * numel, where
            else:
                assert res["read"] < 0.55 * 3 * numel, where
        data = results[-1]
        assert data["diff"] == 0.0 and data["order"], (rank, data)


# --------------------------------------------------------------------------- resharding
GA = 2
RESHARD = {"A": ((2, 2), (3, 3)), "B": ((3, 3), (1, 0)), "C": ((4, 0), (2, 3)),
           "D": ((2, 3), (2, 1))}


def _reference(save_world, load_world):
    """Single-process AdamW over the global batches the two runs saw."""
    model = R.make_model()
    opt = R.adamw(model.parameters())
    for step in range(BEFORE + AFTER):
        world = save_world if step < BEFORE else load_world
        opt.zero_grad(set_to_none=True)
        for micro in range(GA):
            xs, ys = zip(*(R.micro_batch(step, r, micro) for r in range(world)))
            (model(torch.cat(xs), torch.cat(ys)) / GA).backward()
        opt.step()
    return _params(model)


def _reshard_job(rank, world, root, saves, loads):
    out = {}
    for name in saves:
        engine, _, _ = _engine(R.engine_config(stage=RESHARD[name][0][1], ga=GA))
        _train(engine, rank, ga=GA, first=0, steps=BEFORE)
        engine.save_checkpoint(os.path.join(root, name))
    for name in loads:
        (save_world, _), (_, stage) = RESHARD[name]
        engine, model, _ = _engine(R.engine_config(stage=stage, ga=GA), seed=3)
        engine.load_checkpoint(os.path.join(root, name))
        _train(engine, rank, ga=GA, first=BEFORE, steps=AFTER)
        out[name] = R.max_diff(_params(model), _reference(save_world, world))
    return out


def test_checkpoints_reshard_across_world_sizes_and_stages(worlds, tmp_path):
    root = str(tmp_path)
    worlds.run(2, _reshard_job, root, ["A", "D"], [])
    results = worlds.run(3, _reshard_job, root, ["B"], ["A"])
    worlds.run(4, _reshard_job, root, ["C"], [])
    results += worlds.run(1, _reshard_job, root, [], ["B"])
    results += worlds.run(2, _reshard_job, root, [], ["C", "D"])
    diffs = [d for per_rank in results for d in per_rank.values()]
    assert len(diffs) == 3 + 1 + 2 * 2 and max(diffs) <= 1e-5, results


# --------------------------------------------------------------------------- atomicity
def _crash_during_save(rank, world, root, point):
    from safetensors.torch import save_file
    from zerotrain.checkpoint.fs import CRASH_ENV
    engine, model, _ = _engine(R.engine_config(stage=1))
    _train(engine, rank, ga=1, first=0, steps=2)
    engine.save_checkpoint(root, tag="good")
    save_file(_params(model), os.path.join(root, "expected.safetensors"))
    _train(engine, rank, ga=1, first=2, steps=1)
    os.environ[CRASH_ENV] = point
    engine.save_checkpoint(root, tag="good" if point == "swap" else "next")
    return "survived"


def _after_crash(rank, world, root):
    from safetensors.torch import load_file
    engine, model, _ = _engine(R.engine_config(stage=1), seed=2)
    path, _ = engine.load_checkpoint(root)
    diff = R.max_diff(_params(model), load_file(os.path.join(root, "expected.safetensors")))
    left = sorted(os.listdir(root))
    engine.comm.barrier()   # every rank has looked before rank 0 tidies up
    engine.save_checkpoint(root, tag="after")
    return {"path": os.path.basename(path), "diff": diff, "left": left,
            "tidy": sorted(os.listdir(root))}


@pytest.mark.parametrize("point", ["file", "swap"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(worlds, tmp_path, point):
    root = str(tmp_path)
    with pytest.raises(RuntimeError, match="died without a result"):
        run_world(_crash_during_save, 1, root, point)
    for res in worlds.run(2, _after_crash, root):
        assert res["path"] in ("good", f".old-good-{res['path'][-12:]}") and res["diff"] == 0.0
        assert any(n.startswith(".tmp-" if point == "file" else ".old-good-")
                   for n in res["left"]), res
        assert res["tidy"] == ["after", "expected.safetensors", "good", "latest",
                               "zero_to_fp32.py"], res


# --------------------------------------------------------------------------- export
def _export_job(rank, world, root):
    engine, model, _ = _engine(R.engine_config(stage=2, ga=1), model=ExtrasNet())
    _train(engine, rank, ga=1, first=0, steps=2)
    engine.save_checkpoint(root)
    expected = {**_params(model), **{n: b.clone() for n, b in model.named_buffers()}}
    fresh, fresh_model, _ = _engine(R.engine_config(stage=0), model=ExtrasNet(seed=4))
    fresh.load_checkpoint(root, load_module_only=True)
    loaded = {**_params(fresh_model), **dict(fresh_model.named_buffers())}
    return {"expected": expected, "module_only": R.max_diff(
        {k: v for k, v in expected.items() if k != "scratch"},
        {k: v for k, v in loaded.items() if k != "scratch"}),
        "counters": fresh.global_steps, "opt_state": len(fresh.optimizer.state[
            fresh.stage.shard_records()[0].master])}


def test_export_gives_the_full_fp32_model_in_hugging_face_layout(worlds, tmp_path):
    from safetensors.torch import load_file
    from zerotrain.checkpoint import (convert_zero_checkpoint_to_fp32_state_dict,
                                      get_fp32_state_dict_from_zero_checkpoint)
    from zerotrain.checkpoint.full_weights import consolidate_main
    root = str(tmp_path / "ckpt")
    result = worlds.run(2, _export_job, root)[0]
    assert result["module_only"] == 0.0 and result["counters"] == 0 and result["opt_state"] == 0
    expected = {k: v for k, v in result["expected"].items() if k != "scratch"}
    state = get_fp32_state_dict_from_zero_checkpoint(root)
    assert list(state) == list(ExtrasNet().state_dict().keys())
    assert all(torch.equal(state[k], expected[k].to(state[k].dtype)) for k in expected)
    assert state["running"].dtype == torch.float32 and state["count"].dtype == torch.int64
    out = str(tmp_path / "hf")
    convert_zero_checkpoint_to_fp32_state_dict(root, out, max_shard_size="1KB")
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged = {k: v for f in files for k, v in load_file(os.path.join(out, f)).items()}
    assert set(index["weight_map"]) == set(merged) == set(state)
    assert all(torch.equal(merged[k], state[k]) for k in state)
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "tiny"
    cli_out = str(tmp_path / "cli")
    assert consolidate_main([root, cli_out, "--tag", "global_step2"]) == 0
    assert load_file(os.path.join(cli_out, "model-00001-of-00001.safetensors")).keys() == \
        state.keys()
    assert consolidate_main([str(tmp_path / "nothing"), cli_out]) == 1


# --------------------------------------------------------------------------- frozen left out
def _left_out_job(rank, world, root):
    """exclude_frozen_parameters at stages 2 (an asynchronous save) and 3 (a frozen shard
    record), each loaded at the other stage: the load keeps the model's frozen value and
    restores the rest; a model in which the left-out parameter trains cannot load; the
    recovery script is never run by a load."""
    import zerotrain.utils
    out = {}
    for stage in (2, 3):
        cfg = R.engine_config(stage=stage, ga=1)
        engine, model, _ = _engine(cfg, model=ExtrasNet())
        _train(engine, rank, ga=1, first=0, steps=2)
        out[f"frozen records {stage}"] = len(engine.stage.frozen_records())
        engine.save_checkpoint(os.path.join(root, f"all{stage}"))
        engine.save_checkpoint(os.path.join(root, f"ex{stage}"), async_save=stage == 2,
                               exclude_frozen_parameters=True)
        engine.wait_for_checkpoint()
        trained = {**_params(model), **{n: b.clone() for n, b in model.named_buffers()}}
        if rank == 0:   # a load must never run what lies in the save directory
            with open(os.path.join(root, f"ex{stage}", "zero_to_fp32.py"), "w") as f:
                f.write(f"open({os.path.join(root, f'ran{stage}')!r}, 'w').close()\n")
        engine.comm.barrier()
        load_cfg = R.engine_config(stage=5 - stage, ga=1)   # 2 -> 3, 3 -> 2
        fresh, fresh_model, _ = _engine(load_cfg, model=ExtrasNet(seed=4))
        fresh.load_checkpoint(os.path.join(root, f"ex{stage}"))
        loaded = {**_params(fresh_model), **dict(fresh_model.named_buffers())}
        out[f"kept {stage}"] = torch.equal(loaded["frozen"], ExtrasNet(seed=4).frozen)
        out[f"restored {stage}"] = R.max_diff(
            {k: v for k, v in trained.items() if k not in ("frozen", "scratch")},
            {k: v for k, v in loaded.items() if k not in ("frozen", "scratch")})
        fresh.destroy()
        thawed = ExtrasNet(seed=4)
        thawed.frozen.requires_grad_(True)
        other, _, _ = _engine(load_cfg, model=thawed)
        out[f"thawed {stage}"] = _expect_error(
            lambda: other.load_checkpoint(os.path.join(root, f"ex{stage}")))
        logged = []
        info, zerotrain.utils.logger.info = zerotrain.utils.logger.info, logged.append
        try:   # DeepSpeed's helper, as its test reaches it: a missing file is logged
            other._change_recovery_script_permissions(os.path.join(root, "no", "x.py"))
        finally:
            zerotrain.utils.logger.info = info
        out[f"chmod logged {stage}"] = logged
        other.destroy()
        engine.destroy()
    return out


def test_frozen_parameters_left_out_of_a_save_are_kept_from_the_model(worlds, tmp_path):
    import runpy
    import sys
    from safetensors.torch import load_file
    from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint
    root = str(tmp_path)
    res = worlds.run(2, _left_out_job, root)[0]
    assert res["frozen records 3"] > 0 and res["frozen records 2"] == 0, res
    for stage in (2, 3):
        assert res[f"kept {stage}"] and res[f"restored {stage}"] == 0.0, res
        assert "'frozen' is trainable in the model" in res[f"thawed {stage}"], res
        assert "exclude_frozen_parameters=True" in res[f"thawed {stage}"], res
        assert len(res[f"chmod logged {stage}"]) == 1, res
        assert "Could not change permissions" in res[f"chmod logged {stage}"][0], res
        assert not os.path.exists(os.path.join(root, f"ran{stage}"))
        manifest = json.load(open(os.path.join(root, f"ex{stage}", "global_step2",
                                               "manifest.json")))
        assert [e["name"] for e in manifest["excluded_frozen"]] == ["frozen"]
        state = get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, f"ex{stage}"))
        assert set(state) == set(ExtrasNet().state_dict()) - {"frozen"}
    # DeepSpeed's module file below stage 3, weights only, frozen parameters as asked
    files = {k: os.path.join(root, k, "global_step2", "mp_rank_00_model_states.pt")
             for k in ("all2", "ex2", "all3")}
    assert not os.path.exists(files["all3"])
    every = torch.load(files["all2"], weights_only=True)
    trainable = torch.load(files["ex2"], weights_only=True)
    assert list(every["module"]) == list(ExtrasNet().state_dict())
    assert list(trainable["module"]) == [k for k in every["module"] if k != "frozen"]
    assert os.path.getsize(files["all2"]) > os.path.getsize(files["ex2"])
    full = get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, "all2"))
    assert all(torch.equal(every["module"][k].to(full[k].dtype), full[k]) for k in full)
    assert every["dp_world_size"] == 2 and every["global_steps"] == 2
    assert [list(g) for g in every["param_shapes"]] == [
        [n for n in ExtrasNet().state_dict() if n in dict(R.make_model().named_parameters())]]
    # the recovery script DeepSpeed users run: `python zero_to_fp32.py . out`
    script = os.path.join(root, "all2", "zero_to_fp32.py")
    assert os.access(script, os.X_OK)
    out = str(tmp_path / "recovered.safetensors")
    argv, sys.argv = sys.argv, [script, os.path.join(root, "all2"), out]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv
    recovered = load_file(out)
    assert recovered.keys() == full.keys()
    assert all(torch.equal(recovered[k], full[k]) for k in full)


# --------------------------------------------------------------------------- errors
def _expect_error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__}: {exc}"
    return None


def _corrupt(root, name, edit):
    """Rank 0: copy the checkpoint to ``root/name`` and break the copy with ``edit``."""
    target = os.path.join(root, name)
    shutil.copytree(os.path.join(root, "good"), target)
    manifest_path = os.path.join(target, "global_step1", "manifest.json")
    manifest = json.load(open(manifest_path))
    edit(os.path.join(target, "global_step1"), manifest)
    json.dump(manifest, open(manifest_path, "w"))


def _retype_master(tag_dir, manifest):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    path = os.path.join(tag_dir, "rank00001.safetensors")
    tensors = load_file(path)
    with safe_open(path, framework="pt") as f:   # keep its rank and save id
        metadata = f.metadata()
    tensors["rec0/master"] = tensors["rec0/master"].double()
    save_file(tensors, path, metadata=metadata)
    manifest["file_sizes"]["rank00001.safetensors"] = os.path.getsize(path)


def _replace_rank1_file(source):
    """Copy ``source(tag_dir)`` over rank 1's file and record its size, as a file copied
    from elsewhere can match the recorded size."""
    def edit(tag_dir, manifest):
        path = os.path.join(tag_dir, "rank00001.safetensors")
        shutil.copy(source(tag_dir), path)
        manifest["file_sizes"]["rank00001.safetensors"] = os.path.getsize(path)
    return edit


CORRUPTIONS = {
    "truncated": lambda d, m: open(os.path.join(d, "rank00001.safetensors"), "r+b").truncate(100),
    "missing": lambda d, m: os.remove(os.path.join(d, "rank00000.safetensors")),
    "traversal": lambda d, m: m["records"][0]["files"].__setitem__(1, "../../secret"),
    "dtype": lambda d, m: m["records"][0].__setitem__("dtype", "F16"),
    "file_dtype": _retype_master,
    "swapped": _replace_rank1_file(lambda d: os.path.join(d, "rank00000.safetensors")),
    "other_save": _replace_rank1_file(lambda d: os.path.join(
        os.path.dirname(os.path.dirname(d)), "later", "global_step2", "rank00001.safetensors")),
}


def _error_job(rank, world, root):
    import zerotrain
    engine, _, _ = _engine(R.engine_config(stage=1))
    _train(engine, rank, ga=1, first=0, steps=1)
    good = os.path.join(root, "good")
    engine.save_checkpoint(good)
    _train(engine, rank, ga=1, first=1, steps=1)
    engine.save_checkpoint(os.path.join(root, "later"))
    if rank == 0:
        for name, edit in CORRUPTIONS.items():
            _corrupt(root, name, edit)
    engine.comm.barrier()
    out = {name: _expect_error(lambda: _engine(R.engine_config(stage=1))[0].load_checkpoint(
        os.path.join(root, name))) for name in CORRUPTIONS}
    out["wider"] = _expect_error(lambda: _engine(R.engine_config(stage=2), model=WiderNet())[0]
                                 .load_checkpoint(good))
    out["extra"] = _expect_error(lambda: _engine(R.engine_config(stage=0), model=ExtrasNet())[0]
                                 .load_checkpoint(good))
    out["client"] = _expect_error(lambda: engine.save_checkpoint(
        good, tag="bad", client_state={"meta": {"t": object()}}))
    out["no_tag"] = _expect_error(lambda: engine.load_checkpoint(good, tag="global_step9"))
    out["split_dir"] = _expect_error(lambda: engine.save_checkpoint(   # each rank its own dir
        os.path.join(root, f"exp{rank}")))
    out["no_dir"] = engine.load_checkpoint(os.path.join(root, "absent"))
    out["no_pickle"] = _load_without_pickle(good)
    out["alive"] = zerotrain.initialize(model=R.make_model(), config=R.engine_config(
        stage=1))[0].load_checkpoint(good)[0] is not None   # the group still works
    return out


def _load_without_pickle(save_dir):
    """Loading must not unpickle: pickle and torch.load raise while it runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("load_checkpoint unpickled something")
    engine, _, _ = _engine(R.engine_config(stage=2))
    saved = (pickle.load, pickle.loads, pickle.Unpickler, torch.load)
    pickle.load = pickle.loads = pickle.Unpickler = torch.load = refuse
    try:
        return engine.load_checkpoint(save_dir)[0] is not None
    finally:
        pickle.load, pickle.loads, pickle.Unpickler, torch.load = saved


def test_bad_checkpoints_raise_named_errors_on_every_rank(worlds, tmp_path):
    per_rank = worlds.run(2, _error_job, str(tmp_path))
    for rank, out in enumerate(per_rank):
        assert "rank00001.safetensors" in out["truncated"], out["truncated"]
        assert "rank00000.safetensors" in out["missing"] and "missing" in out["missing"]
        assert "outside the checkpoint directory" in out["traversal"], out["traversal"]
        assert "F16" in out["dtype"], out["dtype"]
        # a file from another rank or another save, with the recorded size, is refused
        reader_of_file1 = rank == 1   # the other rank names it
        assert ("holds rank 0's shards, not rank 1's" if reader_of_file1 else "rank 1") in \
            out["swapped"], out["swapped"]
        assert ("not written by the save" if reader_of_file1 else "rank 1") in \
            out["other_save"], out["other_save"]
        assert out["file_dtype"] and ("F64" in out["file_dtype"] or "rank 1" in
                                      out["file_dtype"]), out["file_dtype"]
        assert "'hidden.weight'" in out["wider"] and "(30, 13)" in out["wider"], out["wider"]
        assert "'frozen'" in out["extra"], out["extra"]
        assert "client_state['meta']['t']" in out["client"], out["client"]
        assert "disagree on the checkpoint directory" in out["split_dir"], out["split_dir"]
        assert "exp0" in out["split_dir"] and "rank 1 has" in out["split_dir"], out["split_dir"]
        assert "torch tensors" in out["client"], out["client"]  # lists what is supported
        assert "global_step9" in out["no_tag"], out["no_tag"]
        assert out["no_dir"] == (None, None)
        assert out["no_pickle"] and out["alive"]


# --------------------------------------------------------------------------- one rank only
SHORT_TIMEOUT_S = 30   # a regression that waits out comms_timeout fails fast
ONE_RANK_CASES = [(0, 1, "save"), (2, 1, "save"), (3, 1, "save"), (3, 5, "save"),
                  (2, 2, "load"), (3, 5, "load"), (2, 2, "unmanaged")]
# (stage, step, call); stage 3 at step 5: a launch plan stands; "unmanaged": a save with
# managed_gradient_accumulation false (votes of another shape)


def _one_rank_job(rank, world, root, cases):
    """Rank 0 alone calls ``save_checkpoint``/``load_checkpoint`` (as under ``if rank ==
    0:``) while rank 1 trains on: both raise RankDivergenceError naming the call, at once."""
    import time
    import zerotrain
    from zerotrain.errors import RankDivergenceError
    out = {}
    for stage, at, call in cases:
        model = R.make_model(0)
        config = R.engine_config(stage=stage, comms_timeout=SHORT_TIMEOUT_S)
        if call == "unmanaged":
            config["managed_gradient_accumulation"] = False
        engine, *_ = zerotrain.initialize(model=model, config=config)
        where = os.path.join(root, f"{stage}-{at}-{call}")
        begin = time.monotonic()
        try:
            for step in range(at + 2):
                if step == 1:
                    engine.save_checkpoint(where, tag="all")   # every rank: goes through
                if step == at and rank == 0:
                    if call == "load":
                        engine.load_checkpoint(where, tag="all")
                    else:
                        engine.save_checkpoint(where, tag="lonely")
                engine.backward(engine(*R.micro_batch(step, rank, 0)))
                engine.step()
            result = "no error"
        except RankDivergenceError as exc:
            result = f"RankDivergenceError: {exc}"
        except Exception as exc:  # noqa: BLE001 - the error is the result
            result = f"{type(exc).__name__}: {exc}"
        out[(stage, at, call)] = (result, time.monotonic() - begin)
        engine.destroy()
    return out


@pytest.mark.slow
def test_a_save_or_load_on_one_rank_only_raises_divergence_on_every_rank_at_once(worlds,
                                                                                 tmp_path):
    for res in worlds.run(2, _one_rank_job, str(tmp_path), ONE_RANK_CASES):
        for (stage, at, call), (result, seconds) in res.items():
            assert result.startswith("RankDivergenceError"), (stage, at, call, result)
            named = "load" if call == "load" else "save"
            assert f"{named}_checkpoint()" in result, (stage, at, call, result)
            assert seconds < SHORT_TIMEOUT_S / 2, (stage, at, call, seconds)
