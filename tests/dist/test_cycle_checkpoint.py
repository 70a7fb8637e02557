"""OneCycle and LRRangeTest from the config on a 2-rank engine: a checkpoint taken
mid-cycle resumes onto the same lr, beta1 and weights as the run that never stopped."""
import os

import pytest

import reference as R

BEFORE, AFTER = 4, 5   # the save falls in the cycle's falling half; the resume ends in decay
ONE_CYCLE = {"type": "OneCycle", "params": {
    "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3,
    "cycle_second_step_size": 3, "decay_step_size": 2, "decay_lr_rate": 0.5,
    "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}}
RANGE_TEST = {"type": "LRRangeTest", "params": {
    "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2,
    "lr_range_test_staircase": True}}
CASES = [(1, ONE_CYCLE, 2), (3, ONE_CYCLE, 1), (2, RANGE_TEST, 1)]   # stage, schedule, ga


def _hyper(engine):
    group = engine.optimizer.param_groups[0]
    return float(group["lr"]), tuple(float(b) for b in group["betas"])


def _run(engine, rank, *, ga, first, steps):
    seen = []
    for step in range(first, first + steps):
        for micro in range(ga):
            engine.backward(engine(*R.micro_batch(step, rank, micro)))
            engine.step()
        seen.append(_hyper(engine))
    return seen


def _params(model):
    import zerotrain
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _resume_cases(rank, world, root):
    import zerotrain
    out = []
    for stage, schedule, ga in CASES:
        cfg = R.engine_config(stage=stage, ga=ga, scheduler=schedule)

        def engine(seed=0):
            model = R.make_model(seed)
            return zerotrain.initialize(model=model, config=cfg)[0], model

        straight, model = engine()
        start = _hyper(straight)
        seq_straight = _run(straight, rank, ga=ga, first=0, steps=BEFORE + AFTER)
        first, _ = engine()
        _run(first, rank, ga=ga, first=0, steps=BEFORE)
        save_dir = os.path.join(root, f"cycle{stage}{schedule['type']}")
        first.save_checkpoint(save_dir)
        resumed, resumed_model = engine(seed=1)
        resumed.load_checkpoint(save_dir)
        loaded = _hyper(resumed)
        seq_resumed = _run(resumed, rank, ga=ga, first=BEFORE, steps=AFTER)
        out.append({"case": (stage, schedule["type"]), "start": start,
                    "straight": seq_straight, "resumed": seq_resumed, "loaded": loaded,
                    "state": resumed.lr_scheduler.state_dict(),
                    "diff": R.max_diff(_params(model), _params(resumed_model))})
    return out


def test_mid_cycle_checkpoint_resumes_identically(worlds, tmp_path):
    per_rank = worlds.run(2, _resume_cases, str(tmp_path))
    for rank, results in enumerate(per_rank):
        for res in results:
            where = f"rank {rank} {res['case']}"
            straight = res["straight"]
            assert res["diff"] == 0.0, where
            assert res["loaded"] == straight[BEFORE - 1], where     # lr and betas came back
            assert res["resumed"] == straight[BEFORE:], where
            assert res["state"] == {"last_batch_iteration": BEFORE + AFTER - 1}, where
            lrs = [lr for lr, _ in straight]
            if res["case"][1] == "OneCycle":
                # construction: (min lr, (min mom, 0.99)); batch k sits at height s(k + 1)
                # of a 3 + 3 cycle, then decay batch j = k - 5 runs at 1e-3 / (1 + j / 4)
                assert res["start"] == (1e-3, (0.85, 0.99)), where
                heights = [1 / 3, 2 / 3, 1, 2 / 3, 1 / 3, 0]
                expected = [1e-3 + 9e-3 * s for s in heights]
                expected += [1e-3 / (1 + 0.5 * j / 2) for j in range(1, 4)]
                assert lrs == pytest.approx(expected, abs=1e-12), where
                betas = [b for _, b in straight]
                assert [b[0] for b in betas[:6]] == pytest.approx(
                    [0.95 - 0.1 * s for s in heights], abs=1e-12), where
                assert [b[0] for b in betas[6:]] == [0.95] * 3, where   # no mom decay rate
                assert {b[1] for b in betas} == {0.99}, where
            else:
                # staircase: 1e-3 * (1 + floor((k + 1) / 2))
                assert lrs == pytest.approx([1e-3 * (1 + (k + 1) // 2) for k in range(len(lrs))],
                                            abs=1e-12), where
