"""Stages 0-2 once the ranks agree on a cycle's votes (Note "vote plans" in
engine/vote_plan.py): a steady step makes no collective and no host read of the checks'
own, and a rank that leaves the plan still stops every rank, with RankDivergenceError,
within the step where the ranks part."""
import pytest
import torch

import moe_models as M
import reference as R

pytestmark = pytest.mark.slow

WARM = 4     # windows before the plan stands (it needs two equal cycles) and is counted
COUNTED = 2  # windows counted


def _engine(stage, ga, **extra):
    import zerotrain
    config = R.engine_config(stage=stage, ga=ga, **extra)
    engine, *_ = zerotrain.initialize(model=M.make_model(2), config=config)
    return engine


def _window(engine, rank, step, ga):
    for micro in range(ga):
        x, route, y = M.batch(ga * step + micro, rank, n_experts=2, random_routes=True)
        engine.backward(engine(x, route, y))
        engine.step()


def _counted(rank, stage, ga, votes, extra):
    engine = _engine(stage, ga, backward_votes=votes, **extra)
    for step in range(WARM):
        _window(engine, rank, step, ga)
    ledger = engine.comm.ledger
    ledger.reset()
    for step in range(WARM, WARM + COUNTED):
        _window(engine, rank, step, ga)
    counts = (dict(ledger.calls), dict(ledger.host_reads),
              {op: n for op, n in ledger.elements.items() if op != "divergence_check"},
              ledger.elements["divergence_check"])
    weights = [p.detach().clone() for p in engine.module.parameters()]
    engine.close()
    return counts, weights


STEADY = [(0, 1, {}), (1, 1, {}), (2, 1, {}), (0, 4, {}), (1, 4, {}), (2, 4, {}),
          (1, 2, {"zero_optimization": {"stage": 1, "overlap_comm": True,
                                        "reduce_bucket_size": 64}}),
          (2, 1, {"gradient_clipping": 1.0, "fp16": {"enabled": True, "auto_cast": True,
                                                     "initial_scale_power": 8}})]


def _steady(rank, world):
    return [(_counted(rank, stage, ga, True, extra), _counted(rank, stage, ga, False, extra))
            for stage, ga, extra in STEADY]


def test_a_steady_step_makes_no_collective_or_host_read_of_the_checks_own(worlds):
    for rank, runs in enumerate(worlds.run(2, _steady)):
        for (stage, ga, extra), (checked, unchecked) in zip(STEADY, runs):
            (calls, reads, elements, check), weights = checked
            (plain_calls, plain_reads, plain_elements, plain_check), plain = unchecked
            case = (rank, stage, ga, sorted(extra))
            assert calls == plain_calls, (case, calls, plain_calls)
            assert elements == plain_elements, (case, elements, plain_elements)
            assert reads == plain_reads == {"step fingerprint": COUNTED}, (case, reads)
            assert check == plain_check == 2 * 16 * COUNTED, (case, check)   # fingerprints
            assert all(torch.equal(a, b) for a, b in zip(weights, plain)), case


PLANNED = 4   # the step at which rank 1 parts, after the plan stands


def _inject(rank, world, stage, kind, ga, folder):
    """Train; at micro-step ``PLANNED * ga + ga - 1`` rank 1 parts as ``kind`` says.
    Returns (micro-step reached, whether a plan stood there, error name, message)."""
    engine = _engine(stage, ga, comms_timeout=20)   # a wait would fail the test
    bad_micro = PLANNED * ga + ga - 1
    planned, micro = None, 0
    try:
        for micro in range(bad_micro + 2 * ga):
            bad = rank == 1 and micro == bad_micro
            if micro == bad_micro:
                planned = engine._vote_plan.plan is not None
            x, route, y = M.batch(micro, rank, n_experts=2, random_routes=True)
            if not (bad and kind == "skip_backward"):
                engine.backward(engine(x, route, y))
            if bad and kind == "extra_backward":
                engine.backward(engine(x, route, y))
            if bad and kind == "extra_direct_backward":
                engine(x, route, y).backward()
            if bad and kind == "save":
                engine.save_checkpoint(f"{folder}/{world}_{stage}")
            engine.step()
        return (micro, planned, None, None)
    except Exception as exc:   # noqa: BLE001 - the error is the result
        return (micro, planned, type(exc).__name__, str(exc))


LEAVING = [(0, "extra_backward", 1), (1, "extra_backward", 1), (2, "extra_backward", 1),
           (2, "extra_backward", 2), (2, "extra_direct_backward", 1),
           (1, "extra_direct_backward", 4), (2, "skip_backward", 1),
           (0, "skip_backward", 4), (2, "save", 1)]


def _leaving(rank, world, folder):
    from zerotrain.comm.setup import group_timeout, set_group_timeout
    saved = group_timeout()   # the pool's ranks run later tests with their own timeout
    try:
        return {case: _inject(rank, world, *case, folder) for case in LEAVING}
    finally:
        set_group_timeout(saved)


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_leaves_the_plan_stops_every_rank_within_the_step(worlds, world,
                                                                      tmp_path):
    per_rank = worlds.run(world, _leaving, str(tmp_path))
    for case in LEAVING:
        stage, kind, ga = case
        bad_micro = PLANNED * ga + ga - 1
        messages = []
        for rank in range(world):
            micro, planned, name, message = per_rank[rank][case]
            assert planned is True, (case, rank)
            assert name == "RankDivergenceError", (case, rank, name, message)
            assert micro == bad_micro, (case, rank, micro, message)   # within its step
            assert f"rank {rank}:" in message, message
            messages.append(message.split(": ", 1)[1])
        assert len(set(messages)) == 1, (case, messages)   # every rank names the same
        assert "rank 1: " in messages[0], messages[0]
        assert "left the cycle's plan: " in messages[0], messages[0]   # where, and how


def _alike(rank, world, stage, ga, save, folder):
    """Every rank saves a checkpoint after a planned step (the plan is left alike: the
    ranks go on, and train as without the save)."""
    engine = _engine(stage, ga)
    for step in range(PLANNED + 3):
        if save and step == PLANNED:
            engine.save_checkpoint(f"{folder}/{stage}_{ga}")
        _window(engine, rank, step, ga)
    weights = [p.detach().clone() for p in engine.module.parameters()]
    plan, left = engine._vote_plan.plan is not None, engine._vote_plan.left
    engine.close()
    return weights, plan, left


def _alike_runs(rank, world, folder):
    return {(stage, ga): (_alike(rank, world, stage, ga, True, folder),
                          _alike(rank, world, stage, ga, False, folder))
            for stage, ga in ((0, 1), (2, 2))}


def test_ranks_that_leave_the_plan_alike_go_on_and_train_as_without(worlds, tmp_path):
    for rank, runs in enumerate(worlds.run(2, _alike_runs, str(tmp_path))):
        for case, ((saved, plan, left), (plain, plain_plan, plain_left)) in runs.items():
            assert left == 1 and plain_left == 0, (rank, case, left, plain_left)
            assert plan and plain_plan, (rank, case)   # planned again two cycles later
            assert all(torch.equal(a, b) for a, b in zip(saved, plain)), (rank, case)
