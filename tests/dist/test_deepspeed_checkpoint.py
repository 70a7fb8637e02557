"""DeepSpeed ZeRO checkpoints resumed in zerotrain at another world size and stage.

The fixtures under tests/fixtures/deepspeed_ckpts/ were written by the real DeepSpeed
(tests/fixtures/make_deepspeed_ckpts.py): ``BEFORE`` steps, a checkpoint, then ``AFTER``
more steps whose fp32 masters are ``expected.safetensors``. Here zerotrain loads the
checkpoint at another world size and stage, trains the same ``AFTER`` steps on the same
samples and must reach DeepSpeed's masters: within 1e-6 in fp32 (measured 7e-9 to 1.5e-8).
In bf16 the forward and backward run on bf16 weights, so a last-bit difference in an fp32
master (summation order of the gradients, the clipping norm) can round a weight to the
neighbouring bf16 value; three correct implementations of these steps (DeepSpeed, zerotrain
and a plain-torch loop) end 2e-5 to 5e-5 apart, while dropping the Adam moments moves the
result by ~2e-3. bf16 is therefore held to 2e-4 (measured 4.6e-5 to 7.8e-5).
"""
import json
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures"))
import ds_fixture as F  # noqa: E402
import make_deepspeed_ckpts as M  # noqa: E402

FIXTURES = M.DEFAULT_OUT


def _resume(rank, world, case_name, stage, gas, micro, out_dir, *, load_optimizer=True,
            save_dir=None):
    """Load the DeepSpeed checkpoint into a fresh zerotrain engine, train AFTER steps,
    return (step counter, client_state, lr, full fp32 masters on rank 0)."""
    import zerotrain
    from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    with open(os.path.join(FIXTURES, case_name, "case.json"), encoding="utf-8") as f:
        case = json.load(f)
    config = dict(case["config"], train_micro_batch_size_per_gpu=micro,
                  gradient_accumulation_steps=gas, zero_optimization={"stage": stage})
    model = M.make_model(seed=1)              # other weights: the load must replace them
    if case["frozen"]:
        model.norm.requires_grad_(False)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=M.param_groups(model),
                                      config=config)
    path, client = engine.load_checkpoint(save_dir or os.path.join(FIXTURES, case_name,
                                                                   "checkpoint"),
                                          tag=f"global_step{case['before']}",
                                          load_optimizer_states=load_optimizer)
    steps = engine.global_steps
    dtype = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32
    for step in range(case["before"], case["before"] + case["after"]):
        for m in range(gas):
            x, y = M.micro_batch(step, rank, m, world=world, gas=gas, size=micro)
            engine.backward(engine(x.to(dtype), y))
            engine.step()
    engine.save_checkpoint(out_dir, tag="resumed")
    masters = get_fp32_state_dict_from_zero_checkpoint(out_dir, tag="resumed") \
        if rank == 0 else None
    lr = engine.get_lr()[0]
    engine.close()
    return steps, client, lr, masters


def _max_diff(ours: dict, expected: dict) -> float:
    assert sorted(ours) == sorted(expected)
    return max((ours[k].float() - expected[k].float()).abs().max().item() for k in expected)


@pytest.mark.parametrize("case_name,world,stage,gas,micro", [
    ("z2_fp32_w2", 3, 3, 1, 2),      # DeepSpeed ZeRO-2 on 2 ranks -> ZeRO-3 on 3
    ("z3_fp32_w3", 2, 1, 1, 3),      # DeepSpeed ZeRO-3 on 3 ranks -> ZeRO-1 on 2
    ("z1_bf16_w2", 4, 3, 1, 1),      # bf16 (bf16_zero_pp_rank files) on 2 -> ZeRO-3 on 4
    ("z3_bf16_w2", 1, 2, 4, 1),      # bf16 ZeRO-3 on 2 -> ZeRO-2 on 1
    ("z3_frozen_fp32_w2", 4, 2, 1, 1),   # frozen norm, ZeRO-3 on 2 -> ZeRO-2 on 4
    ("z1_fp32_w2", 3, 2, 1, 2),      # ZeRO-1 on 2 -> ZeRO-2 on 3
    ("z2_bf16_w2", 2, 3, 2, 1),      # bf16 ZeRO-2 on 2 -> ZeRO-3 on 2
])
def test_deepspeed_run_continues_in_zerotrain(worlds, tmp_path, case_name, world, stage, gas,
                                              micro):
    expected = load_file(os.path.join(FIXTURES, case_name, "expected.safetensors"))
    results = worlds.run(world, _resume, case_name, stage, gas, micro, str(tmp_path / "out"))
    steps, client, lr, masters = results[0]
    assert steps == M.BEFORE
    assert client["epoch"] == 2 and client["note"] == "saved by the fixture"
    assert client["best"] == [0.5, 0.25] and torch.equal(client["counts"], torch.tensor([1, 2, 3]))
    assert lr == pytest.approx(M.LR)            # WarmupLR continued past its 4 warm-up steps
    tolerance = 2e-4 if "bf16" in case_name else 1e-6
    difference = _max_diff(masters, expected)
    print(f"{case_name} -> {world} ranks, stage {stage}: {difference:.2e} from DeepSpeed")
    assert difference <= tolerance


def test_without_optimizer_state_the_run_does_not_continue_the_same(worlds, tmp_path):
    """The control: the same resume with fresh Adam moments lands far from DeepSpeed's, and
    a checkpoint whose optimizer files are gone loads its weights the same way."""
    expected = load_file(os.path.join(FIXTURES, "z2_fp32_w2", "expected.safetensors"))
    weights_only = tmp_path / "weights_only"
    shutil.copytree(os.path.join(FIXTURES, "z2_fp32_w2", "checkpoint"), weights_only)
    for path in weights_only.glob("global_step*/zero_pp_rank_*_optim_states.pt"):
        path.unlink()
    fresh = worlds.run(2, _resume, "z2_fp32_w2", 2, 1, 3, str(tmp_path / "out"),
                       load_optimizer=False)[0][3]
    assert _max_diff(fresh, expected) > 1e-4
    moduleonly = worlds.run(2, _resume, "z2_fp32_w2", 2, 1, 3, str(tmp_path / "out2"),
                            load_optimizer=False, save_dir=str(weights_only))[0][3]
    assert all(torch.equal(moduleonly[k], fresh[k]) for k in fresh)


def _auto_resume(rank, world, save_dir):
    from zerotrain.errors import ConfigError

    engine = F.build(checkpoint={"auto_resume": save_dir})
    weight = engine.module.fc1.weight.detach().clone()
    steps, lr = engine.global_steps, engine.get_lr()[0]
    engine.close()
    try:
        F.build(checkpoint={"auto_resume": os.path.join(save_dir, F.TAG)})
    except ConfigError as exc:
        return steps, lr, weight, str(exc)
    return steps, lr, weight, None


def test_auto_resume_recognises_a_deepspeed_save_directory(worlds):
    save_dir = os.path.join(FIXTURES, "z2_fp32_w2", "checkpoint")
    steps, lr, weight, error = worlds.run(2, _auto_resume, save_dir)[0]
    module = load_file(os.path.join(FIXTURES, "z2_fp32_w2", "consolidated.safetensors"))
    assert steps == M.BEFORE and lr == pytest.approx(M.LR / 2)
    assert torch.equal(weight, module["fc1.weight"])
    assert error is not None and "one tag of a DeepSpeed checkpoint" in error \
        and save_dir in error


def _damaged_copies(base) -> dict[str, str]:
    """Copies of the z2_fp32_w2 save directory with DeepSpeed's default tag names.

    ``fallback``: global_step12 (what ``latest`` names) has a truncated optimizer file,
    global_step11 lost rank 1's optimizer file, global_step10 and global_step9 are intact
    (in name order global_step9 would come first). ``none_loads``: both tags damaged."""
    source = os.path.join(F.SAVE_DIR, F.TAG)
    rank1 = F.OPTIMS[1]
    layouts = {"fallback": (12, {12: "truncate", 11: "remove", 10: None, 9: None}),
               "none_loads": (3, {3: "truncate", 2: "remove"})}
    roots = {}
    for name, (latest, tags) in layouts.items():
        root = base / name
        for step, damage in tags.items():
            tag_dir = root / f"global_step{step}"
            shutil.copytree(source, tag_dir)
            if damage == "truncate":   # a save killed while writing
                data = (tag_dir / rank1).read_bytes()
                (tag_dir / rank1).write_bytes(data[: len(data) // 2])
            elif damage == "remove":
                (tag_dir / rank1).unlink()
        (root / "latest").write_text(f"global_step{latest}")
        roots[name] = str(root)
    return roots


def _fallback_job(rank, world, roots):
    import logging

    from zerotrain.checkpoint import CheckpointError

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append((record.levelname, record.getMessage()))
    logging.getLogger("zerotrain").addHandler(handler)
    try:
        resumed = F.build(checkpoint={"auto_resume": roots["fallback"]})
    finally:
        logging.getLogger("zerotrain").removeHandler(handler)
    direct = F.build()
    direct.load_checkpoint(roots["fallback"], tag="global_step10")
    ours, theirs = F.snapshot(resumed), F.snapshot(direct)
    same = F.same(ours, theirs)
    resumed.close()
    direct.close()
    try:
        F.build(checkpoint={"auto_resume": roots["none_loads"]})
        refusal = None
    except CheckpointError as exc:
        refusal = str(exc)
    return {"same": same, "steps": int(ours["counters"][0]), "refusal": refusal,
            "skipped": [m for level, m in messages if level == "WARNING" and "skipped" in m],
            "continued": [m for _, m in messages if "continued from" in m]}


def test_auto_resume_walks_older_deepspeed_tags_newest_first_and_never_starts_over(
        worlds, tmp_path):
    """The DeepSpeed fallback follows zerotrain's rules: ``latest`` first, then the other
    ``global_stepN`` by N, one warning per skipped tag; the state is exactly what loading
    the surviving tag directly gives; with every tag damaged it refuses."""
    roots = _damaged_copies(tmp_path)
    results = worlds.run(2, _fallback_job, roots)
    for rank, res in enumerate(results):
        assert res["same"] and res["steps"] == M.BEFORE, res
        skipped = res["skipped"]
        assert len(skipped) == 2, skipped
        assert "global_step12" in skipped[0] and "not a torch.save zip archive" in skipped[0]
        assert "global_step11" in skipped[1] and "1 optimizer-state files" in skipped[1]
        assert res["refusal"] is not None and "does not start over" in res["refusal"]
        assert "global_step3" in res["refusal"] and "global_step2" in res["refusal"]
    assert results[0]["continued"] == [
        f"auto-resume: continued from {os.path.join(roots['fallback'], 'global_step10')} "
        f"at step {M.BEFORE}"]


def _failed_load_job(rank, world):
    """Rank 1's reads fail midway (a disk error on its third read): every rank raises and
    no rank's masters, Adam state, parameters, hyperparameters or counters change."""
    from zerotrain.checkpoint.deepspeed.source import DeepSpeedCheckpoint

    engine = F.build(zero_optimization={"stage": 2})
    F.first_step(engine, rank, world)
    before = F.snapshot(engine)
    original, calls = DeepSpeedCheckpoint.read_into, [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            raise OSError(5, "Input/output error")
        return original(self, *args, **kwargs)

    DeepSpeedCheckpoint.read_into = failing
    try:
        engine.load_checkpoint(F.SAVE_DIR, tag=F.TAG)
        error = None
    except Exception as exc:  # noqa: BLE001 - the point of the test
        error = f"{type(exc).__name__}: {exc}"
    finally:
        DeepSpeedCheckpoint.read_into = original
    unchanged = F.same(before, F.snapshot(engine))
    engine.load_checkpoint(F.SAVE_DIR, tag=F.TAG)
    loads_after = engine.global_steps == M.BEFORE
    engine.close()
    return {"error": error, "unchanged": unchanged, "reads": calls[0],
            "loads_after": loads_after}


def test_a_deepspeed_load_failing_midway_on_one_rank_changes_nothing_on_any(worlds):
    results = worlds.run(2, _failed_load_job)
    for rank, res in enumerate(results):
        assert res["error"] is not None, res
        assert res["unchanged"], (rank, res)
        assert res["loads_after"], res
    assert "Input/output error" in results[1]["error"]
    assert "rank 1 could not read" in results[0]["error"]
    assert results[0]["reads"] > 3     # rank 0 read everything before the agreement
