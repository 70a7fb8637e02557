"""Faults and hostile input: nothing is lost and nothing lies.

Two jobs sharing a save directory, a failed load, bad random-generator state, a bad
``latest``, bad manifest hyperparameters, a caught NonFiniteGradientError: each either
works or fails with a named error, and leaves the training state exactly as it was.
"""
import os
import threading

import pytest

import reference as R
from distributed import run_world


def _engine(config=None, seed=0, model=None):
    import zerotrain
    model = R.make_model(seed) if model is None else model
    engine, *_ = zerotrain.initialize(model=model, config=config or R.engine_config(stage=1))
    return engine, model


# --------------------------------------------------------------------------- concurrent saves
def _saving_job(rank, world, root, name, saves):
    import time
    from zerotrain.checkpoint import CheckpointError
    engine, _ = _engine()
    open(f"{root}-ready-{name}", "w").close()
    while not all(os.path.exists(f"{root}-ready-{n}") for n in ("a", "b")):
        time.sleep(0.01)   # start saving together, so the saves overlap
    refused = []
    for i in range(saves):
        engine.backward(engine(*R.micro_batch(i, rank, 0)))
        engine.step()
        try:
            engine.save_checkpoint(root, tag=f"{name}{i}")
        except CheckpointError as exc:
            refused.append(str(exc))
    return refused


def test_two_jobs_saving_into_one_directory_never_publish_a_broken_tag(tmp_path):
    """Two single-rank jobs save 30 tags each into one directory at the same time: every
    published tag is complete, ``latest`` names one, and a refused save says why."""
    from zerotrain.checkpoint.fs import read_latest
    from zerotrain.checkpoint.manifest import read_manifest
    root = str(tmp_path / "shared")
    refusals: dict = {}

    def job(name):
        refusals[name] = run_world(_saving_job, 1, root, name, 30)[0]

    threads = [threading.Thread(target=job, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(refusals) == {"a", "b"}, refusals
    for message in refusals["a"] + refusals["b"]:
        assert "is saving a checkpoint into" in message and root in message, message
    tags = [e for e in os.listdir(root)
            if not e.startswith(".") and e not in ("latest", "zero_to_fp32.py")]
    assert len(tags) + len(refusals["a"]) + len(refusals["b"]) == 60, (tags, refusals)
    for tag in tags:
        read_manifest(os.path.join(root, tag))  # every file present with its recorded size
    assert read_latest(root) in tags


# --------------------------------------------------------------------------- failed loads
def _snapshot(engine) -> dict:
    """Every piece of training state a load may write, copied."""
    import random
    import torch
    records = engine.stage.shard_records()
    return {
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers()},
        "masters": [r.master.detach().clone() for r in records],
        "state": [{k: v.clone() if torch.is_tensor(v) else v
                   for k, v in r.optimizer_state.items()} for r in records],
        "groups": [{k: v for k, v in g.items() if k != "params"}
                   for g in engine.stage.optimizer.param_groups],
        "members": [len(g["params"]) for g in engine.stage.optimizer.param_groups],
        "counters": [engine.global_steps, engine.micro_steps, engine.skipped_steps,
                     engine.global_samples],
        "rng": [torch.get_rng_state(), random.getstate()]}


def _differences(a, b, path="") -> list:
    """Paths where two snapshots differ (tensors compared bitwise, dtype included)."""
    import torch
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [path + " keys"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [path + " length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def _rewrite(tag_dir, manifest, filename, edit_tensors=None, edit_metadata=None):
    """Rewrite one safetensors file of a tag (and its recorded size)."""
    import json
    from safetensors import safe_open
    from safetensors.torch import save_file
    path = os.path.join(tag_dir, filename)
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = dict(f.metadata() or {})
    if edit_tensors:
        edit_tensors(tensors)
    if edit_metadata:
        rng = json.loads(metadata["rng"])
        edit_metadata(rng)
        metadata["rng"] = json.dumps(rng)
    save_file(tensors, path, metadata=metadata)
    manifest["file_sizes"][filename] = os.path.getsize(path)


def _last_rank_file(manifest):
    return manifest["rank_files"][-1]


LOAD_FAULTS = {   # name -> edit(tag_dir, manifest); each fails after some tensors are read
    "moment_dtype": lambda d, m: _rewrite(d, m, _last_rank_file(m), edit_tensors=lambda t: t.update(
        {"rec0/exp_avg_sq": t["rec0/exp_avg_sq"].double()})),
    "rng_entry": lambda d, m: _rewrite(d, m, _last_rank_file(m), edit_metadata=lambda r: r.pop(
        "python_gauss_next")),
    "rng_words": lambda d, m: _rewrite(d, m, _last_rank_file(m), edit_tensors=lambda t: t.update(
        {"rng/python": t["rng/python"][:7]})),
    "no_members": lambda d, m: m["optimizer"]["param_groups"][0].update(params=[]),
    "lr_nan": lambda d, m: m["optimizer"]["param_groups"][0].update(lr=float("nan")),
    "lr_negative": lambda d, m: m["optimizer"]["param_groups"][0].update(lr=-100),
    "lr_string": lambda d, m: m["optimizer"]["param_groups"][0].update(lr="0.1"),
    "betas": lambda d, m: m["optimizer"]["param_groups"][0].update(betas=[0.9]),
}


def _failed_load_job(rank, world, root, stage):
    import json
    import shutil
    engine, _ = _engine(R.engine_config(stage=stage))
    for step in range(2):
        engine.backward(engine(*R.micro_batch(step, rank, 0)))
        engine.step()
    good = os.path.join(root, f"good{world}")
    engine.save_checkpoint(good)
    if rank == 0:
        for name, edit in LOAD_FAULTS.items():
            target = os.path.join(root, f"{name}{world}")
            shutil.copytree(good, target)
            tag_dir = os.path.join(target, "global_step2")
            manifest_path = os.path.join(tag_dir, "manifest.json")
            with open(manifest_path) as f:
                manifest = json.load(f)
            edit(tag_dir, manifest)
            with open(manifest_path, "w") as f:
                json.dump(manifest, f)
    engine.comm.barrier()
    other, _ = _engine(R.engine_config(stage=stage), seed=1)   # different weights and state
    other.backward(other(*R.micro_batch(5, rank, 0)))
    other.step()
    out = {}
    for name in LOAD_FAULTS:
        before = _snapshot(other)
        try:
            other.load_checkpoint(os.path.join(root, f"{name}{world}"))
            error = None
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            error = f"{type(exc).__name__}: {exc}"
        out[name] = {"error": error, "changed": _differences(before, _snapshot(other))}
    out["good"] = other.load_checkpoint(good)[0] is not None   # and a good load still works
    return out


@pytest.mark.parametrize("world,stage", [(1, 0), (2, 2)])
def test_a_failed_load_leaves_the_training_state_bitwise_unchanged(worlds, tmp_path, world,
                                                                    stage):
    for rank, out in enumerate(worlds.run(world, _failed_load_job, str(tmp_path), stage)):
        assert out.pop("good"), out
        for name, result in out.items():
            assert result["error"] and "CheckpointError" in result["error"], (rank, name, result)
            assert result["changed"] == [], (rank, name, result)
        last = f"rank{world - 1:05d}.safetensors"
        assert last in out["rng_entry"]["error"] or f"rank {world - 1}" in out["rng_entry"][
            "error"], out["rng_entry"]
        for name in ("no_members", "lr_nan", "lr_negative", "lr_string", "betas"):
            assert "param_groups[0]" in out[name]["error"], (name, out[name])


# --------------------------------------------------------------------------- fingerprint
def _mismatch_job(rank, world, case):
    import torch
    from zerotrain.errors import RankMismatchError
    model = R.make_model()
    config = R.engine_config(stage=1)
    shape, dtype = (2, 3), torch.float32
    if rank == 1 and case == "buffer_shape":
        shape = (3, 2)            # same size: a broadcast would not notice
    if rank == 1 and case == "buffer_dtype":
        dtype = torch.int32       # same element size: a broadcast would not notice
    if rank == 1 and case == "config":
        config["gradient_clipping"] = 0.5
    model.register_buffer("stats", torch.zeros(shape, dtype=dtype))
    try:
        _engine(config, model=model)
    except RankMismatchError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("case", ["buffer_shape", "buffer_dtype", "config"])
def test_ranks_that_differ_in_a_buffer_or_a_config_key_are_told_which(worlds, case):
    for message in worlds.run(2, _mismatch_job, case):
        assert message is not None, case
        if case == "config":
            assert "gradient_clipping" in message and "0.5" in message, message
        else:
            assert "buffer" in message and "'stats'" in message, message


# --------------------------------------------------------------------------- comms_timeout
def _stuck_peer_job(rank, world, flag, what, debug):
    import time
    stage = 3 if what == "gather" else 2
    engine, _ = _engine(R.engine_config(stage=stage, comms_timeout=3, debug=debug))
    if rank == 1:   # never joins rank 0's collective; waits for rank 0 to give up
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
        return {"released": os.path.exists(flag)}
    try:
        if what == "save":
            engine.save_checkpoint(os.path.dirname(flag) + "/ckpt")
        else:
            engine.backward(engine(*R.micro_batch(0, rank, 0)))
            engine.step()
        error = None
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        error = f"{type(exc).__name__}: {exc}"
    open(flag, "w").close()
    return {"error": error}


@pytest.mark.parametrize("what, debug", [("step", False), ("save", False), ("gather", False),
                                         ("step", True)])
def test_comms_timeout_applies_to_a_process_group_that_already_existed(tmp_path, what, debug):
    """The test harness creates the group (default timeout) before initialize adopts it:
    rank 0's collective times out after comms_timeout, while rank 1 is still waiting, and
    the error names it (the vote before a stage-2 backward, Note "backwards that reduce" in
    engine/accumulation.py; the vote a save starts with; a stage-3 unit's gathers),
    the group's size and the timeout, with or without ``debug``."""
    rank0, rank1 = run_world(_stuck_peer_job, 2, str(tmp_path / "gave-up"), what, debug,
                             timeout=200)
    assert rank1["released"], (rank0, rank1)
    assert rank0["error"].startswith("CollectiveError: rank 0: "), rank0
    named = {"step": "all_reduce of (6,) torch.int64", "save": "all_reduce of (6,) torch.int64",
             "gather": "all_gather of"}[what]
    assert named in rank0["error"], rank0
    label = {"step": "for backward vote: backward", "save": "for save_checkpoint vote",
             "gather": "for unit "}[what]
    assert label in rank0["error"], rank0
    assert "(group of 2 ranks, timeout 3s)" in rank0["error"], rank0
    assert "did not join this collective in time" in rank0["error"], rank0


# --------------------------------------------------------------------------- non-finite
def _nonfinite_window_job(rank, world):
    import torch
    import zerotrain
    config = R.engine_config(stage=2, ga=2)
    caught, straight = _engine(config)[0], _engine(config)[0]
    x, y = R.micro_batch(0, rank, 0)
    caught.backward(caught(x, y))
    caught.step()
    x, y = R.micro_batch(0, rank, 1)
    x[0, 0] = float("nan")
    caught.backward(caught(x, y))
    try:
        caught.step()
        raised = False
    except zerotrain.NonFiniteGradientError:
        raised = True
    for engine in (caught, straight):   # the same full window on both
        for micro in range(2):
            engine.backward(engine(*R.micro_batch(1, rank, micro)))
            engine.step()
    same = all(torch.equal(a, b) for a, b in zip(caught.module.parameters(),
                                                 straight.module.parameters()))
    return {"raised": raised, "same": same,
            "counters": (caught.global_steps, caught.micro_steps, caught.skipped_steps)}


def test_after_a_caught_nonfinite_error_the_next_step_starts_a_fresh_window(worlds):
    for res in worlds.run(2, _nonfinite_window_job):
        assert res["raised"] and res["same"], res
        assert res["counters"] == (2, 4, 1), res


# --------------------------------------------------------------------------- auto-resume
def _resumed_step(root):
    engine, _ = _engine(R.engine_config(stage=1, checkpoint={"auto_resume": root}))
    return engine.global_steps


def _auto_resume_job(rank, world, base):
    import shutil
    from zerotrain.checkpoint import CheckpointError
    engine, _ = _engine()
    root = os.path.join(base, "ckpt")
    for step in range(3):
        engine.backward(engine(*R.micro_batch(step, rank, 0)))
        engine.step()
        engine.save_checkpoint(root)             # global_step1 .. global_step3
    out = {}
    cases = {}
    for name in ("foreign", "missing_file", "all_broken", "nothing"):
        cases[name] = os.path.join(base, name)
        if rank == 0:
            shutil.copytree(root, cases[name])
    if rank == 0:
        foreign = os.path.join(cases["foreign"], "ds_step9")    # another format's tag
        os.makedirs(foreign)
        open(os.path.join(foreign, "mp_rank_00_states.bin"), "w").close()
        with open(os.path.join(cases["foreign"], "latest"), "w") as f:
            f.write("ds_step9")
        os.remove(os.path.join(cases["missing_file"], "global_step3", "rank00000.safetensors"))
        for tag in ("global_step1", "global_step2", "global_step3"):
            os.remove(os.path.join(cases["all_broken"], tag, "module.safetensors"))
        shutil.rmtree(cases["nothing"])
        os.makedirs(os.path.join(cases["nothing"], "logs"))   # not a checkpoint
    engine.comm.barrier()
    for name, path in cases.items():
        try:
            out[name] = _resumed_step(path)
        except CheckpointError as exc:
            out[name] = str(exc)
    return out


def test_auto_resume_falls_back_to_the_newest_complete_tag_and_never_starts_over(worlds,
                                                                                 tmp_path):
    for out in worlds.run(2, _auto_resume_job, str(tmp_path)):
        assert out["foreign"] == 3, out            # latest names a tag without a manifest
        assert out["missing_file"] == 2, out       # global_step3 lost a file
        assert isinstance(out["all_broken"], str) and "does not start over" in out[
            "all_broken"] and "module.safetensors" in out["all_broken"], out
        assert out["nothing"] == 0, out            # no checkpoint at all: a fresh start


def _subgroup_timeout_job(rank, world):
    from zerotrain.comm import group_timeout, set_group_timeout
    before = group_timeout()
    try:
        engine, _ = _engine(R.engine_config(stage=1, comms_timeout=7))
        sub = engine.comm.subgroup(((0,), (1,)))
        return [group_timeout().total_seconds(), group_timeout(sub.group).total_seconds()]
    finally:   # the pool's group serves later tests: give it its own timeout back
        set_group_timeout(before)
        set_group_timeout(before, sub.group)


def test_subgroups_keep_the_configured_comms_timeout(worlds):
    for timeouts in worlds.run(2, _subgroup_timeout_job):
        assert timeouts == [7.0, 7.0], timeouts
