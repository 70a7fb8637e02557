"""Mixed precision: bf16/fp16 track fp32, and an fp16 overflow on one rank skips everywhere."""
import math

import pytest
import torch

import reference as R

STEPS = 6


def _curves(rank, world, stage):
    import zerotrain
    curves = {}
    for precision in ("fp32", "bf16", "fp16"):
        model = R.make_model()
        engine, *_ = zerotrain.initialize(
            model=model, config=R.engine_config(stage=stage, precision=precision, lr=3e-3))
        curves[precision] = R.train_engine(engine, steps=STEPS, rank=rank, ga=1)
        dtypes = {p.dtype for p in model.parameters()}
        masters = {r.master.dtype for r in engine.stage.shard_records()}
        curves[precision + "_dtypes"] = (sorted(map(str, dtypes)), sorted(map(str, masters)))
    return curves


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_and_fp16_loss_curves_track_fp32(worlds, stage):
    for res in worlds.run(2, _curves, stage):
        assert res["bf16_dtypes"] == (["torch.bfloat16"], ["torch.float32"])
        assert res["fp16_dtypes"] == (["torch.float16"], ["torch.float32"])
        assert res["fp32_dtypes"] == (["torch.float32"], ["torch.float32"])
        for precision, tol in (("bf16", 0.03), ("fp16", 0.005)):
            for ref, got in zip(res["fp32"], res[precision]):
                assert abs(got - ref) <= tol * max(1.0, abs(ref)), (precision, res)


def _overflow(rank, world, stage):
    import zerotrain
    model = R.make_model()
    config = R.engine_config(stage=stage, precision="fp16")
    config["fp16"].update(hysteresis=1, initial_scale_power=10)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    R.train_engine(engine, steps=1, rank=rank, ga=1)
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scale_before = engine.loss_scale
    x, y = R.micro_batch(1, rank, 0)
    if rank == world - 1:
        x[0, 0] = float("inf")  # only the last rank overflows
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    applied_after_overflow = engine.was_step_applied()
    norm = engine.get_global_grad_norm()
    R.train_engine(engine, steps=1, rank=rank, ga=1)  # training goes on afterwards
    return {"unchanged": unchanged, "applied": applied_after_overflow,
            "norm": norm, "skipped": engine.skipped_steps,
            "scale": (scale_before, engine.loss_scale), "global_steps": engine.global_steps,
            "finite_after": all(torch.isfinite(r.master).all().item()
                                for r in engine.stage.shard_records()),
            "applied_next": engine.was_step_applied()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(worlds, stage):
    for res in worlds.run(2, _overflow, stage):
        assert res["unchanged"] and not res["applied"], res
        assert res["norm"] == math.inf, res   # DeepSpeed's value after an overflow (a nan
        # gradient too): Accelerate's clip_grad_norm_ returns it
        assert res["skipped"] == 1 and res["global_steps"] == 3, res
        assert res["scale"] == (1024.0, 512.0), res
        assert res["finite_after"] and res["applied_next"], res


def _nonfinite(rank, world, policy, stage):
    import zerotrain
    model = R.make_model()
    config = R.engine_config(stage=stage, precision="bf16", nonfinite=policy)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    x, y = R.micro_batch(0, rank, 0)
    if rank == 0:
        x[0, 0] = float("nan")
    engine.backward(engine(x, y))
    try:
        engine.step()
    except zerotrain.NonFiniteGradientError as exc:
        return {"error": str(exc)}
    R.train_engine(engine, steps=1, rank=rank, ga=1)
    return {"skipped": engine.skipped_steps, "applied_next": engine.was_step_applied()}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_nonfinite_gradient_raises_on_every_rank_naming_the_parameter(worlds, stage):
    for res in worlds.run(2, _nonfinite, "raise", stage):
        assert "step 1" in res["error"] and "'inp.weight'" in res["error"], res


def test_nonfinite_skip_policy_skips_and_continues(worlds):
    for res in worlds.run(2, _nonfinite, "skip", 2):
        assert res == {"skipped": 1, "applied_next": True}
