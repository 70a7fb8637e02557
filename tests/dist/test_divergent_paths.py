"""Ranks that take different paths through the model (Note "gather check" in
zero3/gather_check.py, Note "leaf modules" in zero3/leaf.py).

Rank 0 routes its samples to expert 0 and rank 1 to expert 1. At stage 3 each expert is a
unit of its own: without a leaf declaration the ranks gather different units of the same
size, which paired up and trained wrong weights without a word; now every rank stops at
that gather naming both units. Declared a leaf, the block is one unit and trains exactly
like one process, as stages 0-2 do.
"""
import contextlib

import pytest
import torch

import moe_models as M
import reference as R

pytestmark = pytest.mark.slow

STEPS = 3


def _engine(stage, *, leaf, n_experts=2, comms_timeout=None, ga=1, **zero):
    import zerotrain
    from zerotrain.utils import set_z3_leaf_modules
    model = M.make_model(n_experts)
    if leaf:
        set_z3_leaf_modules(model, [M.Experts])
    config = R.engine_config(stage=stage, ga=ga)
    if comms_timeout is not None:
        config["comms_timeout"] = comms_timeout
    config["zero_optimization"].update(zero)
    config["zero_optimization"]["leaf_module"] = {"classes": []}   # only what the test flags
    engine, *_ = zerotrain.initialize(model=model, config=config)
    return engine, model


def _weights(engine, model):
    import zerotrain
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return out


def _train(engine, model, rank, *, steps=STEPS, n_experts=2, random_routes=False,
           keep_open=False):
    for step in range(steps):
        loss = engine(*M.batch(step, rank, n_experts=n_experts, random_routes=random_routes))
        engine.backward(loss)
        engine.step()
    return None if keep_open else _weights(engine, model)


def _expert_runs(rank, world):
    out = {}
    for stage, leaf in ((0, False), (2, False), (3, True)):
        engine, model = _engine(stage, leaf=leaf)
        out[(stage, leaf)] = _train(engine, model, rank)
    engine, model = _engine(3, leaf=False)
    try:
        _train(engine, model, rank)
        out["unflagged"] = None
    except Exception as exc:   # noqa: BLE001 - the error is the result
        out["unflagged"] = (type(exc).__name__, str(exc))
    return out


def test_stage3_experts_routed_apart_fail_at_once_or_train_exactly_as_a_leaf(worlds):
    ref = M.reference(steps=STEPS, world=2, n_experts=2, random_routes=False)
    per_rank = worlds.run(2, _expert_runs)
    for rank, out in enumerate(per_rank):
        for case in ((0, False), (2, False), (3, True)):
            assert R.max_diff(out[case], ref) < 1e-5, (rank, case)
        error = out["unflagged"]
        assert error is not None, f"rank {rank}: stage 3 trained without a leaf declaration"
        name, message = error
        assert name == "RankDivergenceError", (rank, error)
        assert "moe.experts.0" in message and "moe.experts.1" in message, message
        assert "set_z3_leaf_modules" in message and "forward pass 1" in message, message


def _inject(rank, world, stage, kind, bad_step=1, steps=3, planned=None, **extra):
    """Train 3 steps (micro-steps, with ``ga`` in ``extra``); at ``bad_step`` rank 1
    diverges as ``kind`` says. Returns
    (step reached, error name, message) of the first error; appends to ``planned``
    whether stage 3's launches followed a plan at ``bad_step`` (zero3/plan.py)."""
    engine, model = _engine(stage, leaf=stage == 3, n_experts=2, **extra)
    moe_forward = model.moe.forward
    step = 0
    try:
        for step in range(steps):
            bad = rank == 1 and step == bad_step
            if planned is not None and step == bad_step:
                planned.append(engine.stage.wire.host.plan.plan is not None)
            x, route, y = M.batch(step, rank, n_experts=2, random_routes=True)
            model.skip_moe = bad and kind == "skip"   # the block is not called at all
            if bad and kind == "raise":
                model.moe.forward = lambda h, route: R.RaiseInBackward.apply(moe_forward(h, route))
            loss = engine(x, route, y)
            model.moe.forward = moe_forward
            if bad and kind == "extra_forward":
                engine(x, route, y)   # e.g. a loss logged on one rank, under grad
            try:
                if kind.startswith("coalesce") and step == bad_step:
                    # two backwards before the step: rank 1 (every rank, "coalesce_all")
                    # holds them in a block and reduces once, the others twice
                    held = bad or kind == "coalesce_all"
                    with engine.coalesce_grad_reduction() if held else contextlib.nullcontext():
                        engine.backward(loss)
                        engine.backward(engine(x, route, y))
                else:   # "repeat_backward": the same loss twice on one rank
                    engine.backward(loss, retain_graph=bad and kind == "repeat_backward")
                    if bad and kind == "repeat_backward":
                        engine.backward(loss)
            except RuntimeError as exc:
                if "injected" not in str(exc):
                    raise
            if bad and kind == "late_forward":
                engine(x, route, y)   # after backward, before the step
            if bad and kind == "extra_backward":   # e.g. an auxiliary loss on one rank
                engine.backward(engine(x, route, y))
            if bad and kind == "extra_direct_backward":
                engine(x, route, y).backward()
            engine.step()
        return (step, None, None)
    except Exception as exc:   # noqa: BLE001 - the error is the result
        return (step, type(exc).__name__, str(exc))


# (2, "coalesce"): rank 1 holds two backwards in coalesce_grad_reduction(), the others
# reduce each; its exit's vote meets their first backward's (Note "backwards that reduce")
CASES = [(0, "extra_forward"), (2, "extra_forward"), (0, "raise"), (2, "raise"),
         (3, "raise"), (3, "skip"), (2, "coalesce")]
BAD_STEP = {"skip": 0}   # here before stage 3 has a trace; the cases below come after


def _injections(rank, world):
    return {case: _inject(rank, world, *case, bad_step=BAD_STEP.get(case[1], 1))
            for case in CASES}


def test_injected_divergence_is_caught_on_every_rank_within_its_step(worlds):
    per_rank = worlds.run(2, _injections)
    for case in CASES:
        for rank in range(2):
            step, name, message = per_rank[rank][case]
            assert name == "RankDivergenceError", (case, rank, name, message)
            assert step == BAD_STEP.get(case[1], 1), (case, rank, step, message)
            assert f"rank {rank}:" in message, message
    held = per_rank[0][(2, "coalesce")][2]   # the block's exit against a plain backward
    assert "rank 1: the exit of coalesce_grad_reduction()" in held, held
    assert "rank 0: backward 1 of micro-step" in held, held


# Once stage 3 has a trace, prefetch and reuse leave a rank's backward starting with a
# gradient reduce-scatter, which an extra forward on another rank meets with a gather:
# gloo pairs neither, and this waited out comms_timeout (Note "held reductions" in
# zero3/gather_check.py). The short timeout turns such a wait into a failed test.
TRACED = ["extra_forward", "late_forward", "skip", "coalesce"]
SHORT_TIMEOUT_S = 20


# From the fourth step on, the launches follow the plan the ranks agreed at the step before
# (Note "launch plans" in zero3/plan.py): no headers, and a rank that leaves the plan sends
# what the others expect up to the step, whose fingerprints then differ.
PLANNED_STEP = 3
PLANNED = TRACED + ["raise"]


def _traced_injections(rank, world):
    from zerotrain.comm.setup import group_timeout, set_group_timeout
    saved = group_timeout()   # the pool's ranks run later tests with their own timeout
    planned: list = []
    try:
        out = {kind: _inject(rank, world, 3, kind, bad_step=1,
                             comms_timeout=SHORT_TIMEOUT_S) for kind in TRACED}
        out.update({(kind, "planned"): _inject(
            rank, world, 3, kind, bad_step=PLANNED_STEP, steps=PLANNED_STEP + 1,
            planned=planned, comms_timeout=SHORT_TIMEOUT_S) for kind in PLANNED})
        # every rank holds the step's backwards in a coalesce_grad_reduction() block: the
        # schedule changed for all, which leaves the plan alike and goes on with headers
        out["coalesce_all"] = _inject(rank, world, 3, "coalesce_all", bad_step=PLANNED_STEP,
                                      steps=PLANNED_STEP + 2, comms_timeout=SHORT_TIMEOUT_S)
        return out, planned
    finally:
        set_group_timeout(saved)


@pytest.mark.parametrize("world", [2, 3])
def test_divergence_after_the_trace_exists_is_caught_at_once_on_every_rank(worlds, world):
    results = worlds.run(world, _traced_injections)
    per_rank = [out for out, _ in results]
    assert all(planned == [True] * len(PLANNED) for _, planned in results), results
    for kind in TRACED + [(kind, "planned") for kind in PLANNED]:
        messages = []
        bad_step = PLANNED_STEP if isinstance(kind, tuple) else 1
        for rank in range(world):
            step, name, message = per_rank[rank][kind]
            assert name == "RankDivergenceError", (kind, rank, name, message)
            assert step == bad_step, (kind, rank, step, message)
            assert f"rank {rank}:" in message and "rank 1: " in message, message
            messages.append(message.split(": ", 1)[1])
        assert len(set(messages)) == 1, (kind, messages)   # every rank names the same
    # each names where the ranks first differ: the unit (module) and the forward or step
    extra = per_rank[0]["extra_forward"][2]   # headers: the launches are named
    assert "gather 0 of forward pass 3" in extra and "'<root>'" in extra, extra
    assert "reduce-scatter" in extra, extra
    extra = per_rank[0][("extra_forward", "planned")][2]   # a plan: the step's trail
    assert "engine forward" in extra and "unit 0 (module '<root>'" in extra, extra
    for skip in (per_rank[0]["skip"][2], per_rank[0][("skip", "planned")][2]):
        assert "use of unit" in skip and "'moe'" in skip, skip
    late = per_rank[0]["late_forward"][2]   # the step met a header: the gather is named
    assert "the optimizer step" in late and "gather 0 of forward pass 3" in late, late
    late = per_rank[0][("late_forward", "planned")][2]
    assert "the optimizer step" in late and "engine forward" in late, late
    held = per_rank[0]["coalesce"][2]   # rank 1 held its backwards, the others reduced
    assert "2 gradient reduce-scatters in the backward" in held, held
    held = per_rank[0][("coalesce", "planned")][2]
    assert "reduce_scatter of" in held and "rank 1: forward" in held, held
    assert all(out["coalesce_all"] == (PLANNED_STEP + 1, None, None) for out in per_rank)


# A rank that runs one more backward than its peers (Note "backwards that reduce" in
# engine/accumulation.py). Where that backward reduces (every one at stage 2, the window's
# last at stages 0-1) its reductions met the peers' next collectives: gloo aborted the
# process or a rank stopped alone while the others waited (on NCCL a hang); now every rank
# votes before such a backward and before each update. (stage, kind, ga, bad micro-step):
# at ga=1 the extra backward meets the peers' update, at ga=2's micro-step 2 (mid-window)
# their next backward at stage 2; mid-window at stage 1 it only accumulates, and the
# step's fingerprint (which notes every backward) catches it, as stage 3's checks do.
EXTRA = [(0, "extra_backward", 1, 1), (1, "extra_backward", 1, 1),
         (1, "repeat_backward", 2, 2), (3, "extra_backward", 1, 1),
         (2, "extra_backward", 1, 1), (2, "extra_backward", 2, 2),
         (2, "extra_direct_backward", 1, 1), (2, "extra_direct_backward", 2, 2),
         (1, "extra_direct_backward", 1, 1)]


def _extra_backwards(rank, world):
    from zerotrain.comm.setup import group_timeout, set_group_timeout
    saved = group_timeout()   # the pool's ranks run later tests with their own timeout
    try:
        out = {case: _inject(rank, world, case[0], case[1], bad_step=case[3], ga=case[2],
                             steps=case[3] + 2, comms_timeout=SHORT_TIMEOUT_S)
               for case in EXTRA if world == 2 or case[0] == 2}
    finally:
        set_group_timeout(saved)
    return out, _votes_per_step(rank, True), _votes_per_step(rank, False)


def _votes_per_step(rank, votes):
    """All-reduces in one stage-2 step (ga=1) with ``backward_votes`` on or off, and the
    verdicts left to be read at the next launch (Note "deferred verdicts" in
    comm/agreement.py), each with whether its vote was still unread then."""
    import zerotrain
    model = M.make_model(2)
    engine, *_ = zerotrain.initialize(model=model, config=R.engine_config(
        stage=2, backward_votes=votes))
    engine.comm.ledger.reset()
    deferred, defer = [], engine.comm.defer
    engine.comm.defer = lambda read: (deferred.append(read), defer(read))
    _train(engine, model, rank, steps=1, keep_open=True)
    engine.close()
    return engine.comm.ledger.calls["all_reduce"], len(deferred)


@pytest.mark.parametrize("world", [2, 3])
def test_an_extra_backward_on_one_rank_is_caught_on_every_rank(worlds, world):
    results = worlds.run(world, _extra_backwards)
    per_rank = [out for out, *_ in results]
    # the norm's all-reduce, and the votes before the backward and the update unless
    # "backward_votes": false, both read at the rank's next launch, not at once
    assert all(voted == (3, 2) and unvoted == (1, 0) for _, voted, unvoted in results), results
    assert len(per_rank[0]) == (len(EXTRA) if world == 2 else 4)
    for case in per_rank[0]:
        stage, kind, ga, bad = case
        voted = stage < 3 and (stage == 2 or ga == 1)   # the extra backward reduces
        messages = []
        for rank in range(world):
            step, name, message = per_rank[rank][case]
            assert name == "RankDivergenceError", (case, rank, name, message)
            assert f"rank {rank}:" in message, message
            if not voted:   # caught at the step (fingerprint) or a stage-3 gather
                assert step in (bad, bad + 1), (case, rank, step, message)
                continue
            # at the vote before the extra backward; the peers at their update (ga=1) or
            # at their next micro-step's backward (ga=2, mid-window)
            assert step == (bad if rank == 1 or ga == 1 else bad + 1), (case, rank, step)
            messages.append(message.split(": ", 1)[1])
        if kind == "repeat_backward":   # the trail names the extra backward
            assert "engine backward" in per_rank[0][case][2], per_rank[0][case]
        if not voted:
            continue
        assert len(set(messages)) == 1, (case, messages)   # every rank names the same
        assert f"rank 1: backward 2 of micro-step {bad}" in messages[0], messages[0]
        peer = (f"the update at micro-step {bad}, after 1 backward(s)" if ga == 1
                else f"backward 1 of micro-step {bad + 1}")
        for other in set(range(world)) - {1}:
            assert f"rank {other}: {peer}" in messages[0], messages[0]


CHAOS_STEPS = {2: 50, 3: 25}   # per stage: 200 steps on 2 ranks, 100 on 3


def _chaos(rank, world, steps):
    """Random rank-dependent routing over 4 experts at every stage (a leaf at 3)."""
    out = {}
    for stage in (0, 1, 2, 3):
        engine, model = _engine(stage, leaf=stage == 3, n_experts=4)
        out[stage] = _train(engine, model, rank, steps=steps, n_experts=4,
                            random_routes=True)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_chaos_random_routing_trains_like_one_process_at_every_stage(worlds, world):
    steps = CHAOS_STEPS[world]
    ref = M.reference(steps=steps, world=world, n_experts=4, random_routes=True)
    for rank, out in enumerate(worlds.run(world, _chaos, steps)):
        for stage, weights in out.items():
            assert R.max_diff(weights, ref) < 1e-4, (world, rank, stage)


def _flat_runs(rank, world):
    """As on NCCL (Communicator.gathers_flat patched on): each unit gather is one flat
    all-gather carrying the header, counted on the ledger per unit gather."""
    from zerotrain.comm import Communicator
    from zerotrain.stages.zero3.unit import Unit
    gathers_flat, start_gather = Communicator.gathers_flat, Unit.start_gather
    starts = []

    def counted(unit):
        if unit.spec.params and unit.shard_numel:
            starts.append(len(unit.spec.params))
        return start_gather(unit)
    # the pool's ranks run later tests too: the patches are undone whatever happens
    Communicator.gathers_flat = lambda self, device: True
    Unit.start_gather = counted
    try:
        return _flat_runs_patched(rank, starts)
    finally:
        Communicator.gathers_flat, Unit.start_gather = gathers_flat, start_gather


def _flat_runs_patched(rank, starts):
    engine, model = _engine(3, leaf=True)
    ledger = engine.comm.ledger
    ledger.reset()
    _train(engine, model, rank, steps=STEPS, keep_open=True)
    launches = ledger.calls["all_gather"]   # before GatheredParameters gathers the result
    header_bytes = ledger.nbytes["divergence_check"]
    trained = list(starts)
    weights = _weights(engine, model)
    engine, model = _engine(3, leaf=False)
    try:
        _train(engine, model, rank)
        error = None
    except Exception as exc:   # noqa: BLE001 - the error is the result
        error = type(exc).__name__
    return weights, launches, trained, header_bytes, error


def test_device_path_gathers_each_unit_in_one_flat_launch_with_its_header(worlds):
    ref = M.reference(steps=STEPS, world=2, n_experts=2, random_routes=False)
    for rank, (weights, launches, starts, header_bytes, error) in enumerate(
            worlds.run(2, _flat_runs)):
        assert R.max_diff(weights, ref) < 1e-5, rank
        assert launches == len(starts) and max(starts) > 1, (launches, starts)
        # 16 bytes per rank per gather; each step's all-reduce carries 16 float32 (x2)
        assert header_bytes == 16 * 2 * launches + STEPS * 2 * 16 * 4, header_bytes
        assert error == "RankDivergenceError", error


class _ByCounter(torch.nn.Module):
    """DeepSpeed's ``ChooseModuleByCounter``: each forward runs the next of two layers."""

    def __init__(self, width=16):
        super().__init__()
        self.linears = torch.nn.ModuleList(
            [torch.nn.Linear(width, width, bias=False) for _ in range(2)])
        self.counter = 0

    def forward(self, x, y):
        x = torch.relu(self.linears[self.counter % 2](x))
        self.counter += 1
        return torch.nn.functional.cross_entropy(x, y)


def _leaf_without_input_grads(rank, world):
    import zerotrain
    from zerotrain.utils import set_z3_leaf_modules
    out = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = _ByCounter()
        if stage == 3:
            set_z3_leaf_modules(model, [_ByCounter])
        engine, *_ = zerotrain.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "zero_optimization": {
                "stage": stage, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
        g = torch.Generator().manual_seed(rank)
        for _ in range(STEPS + 1):   # the inputs need no gradient
            engine.backward(engine(torch.randn(2, 16, generator=g),
                                   torch.randint(0, 16, (2,), generator=g)))
            engine.step()
        with zerotrain.zero.GatheredParameters(list(model.parameters())):
            out[stage] = [p.detach().clone() for p in model.parameters()]
        engine.destroy()
    return all(torch.equal(a, b) for a, b in zip(out[0], out[3]))


def test_a_leaf_module_whose_inputs_need_no_gradient_trains_like_stage_0(worlds):
    """DeepSpeed's backward reads the leaf's released parameters here and fails (a
    deliberate difference, docs/from-deepspeed.md); zerotrain trains it exactly."""
    assert worlds.run(2, _leaf_without_input_grads) == [True, True]


# A forward that raises on one rank (an out-of-memory error the script catches) and is
# retried on a smaller batch: no collective differs at stages 0-2 (a forward launches
# none), so the step must go on as if the failed attempt had not happened (Note "a forward
# that raises" in comm/trail.py); it counted as an extra forward and stopped every rank.
def _retried_forward(rank, world, stage, fail, ga):
    engine, model = _engine(stage, leaf=False, ga=ga)
    moe_forward = model.moe.forward
    for step in range(3):
        for micro in range(ga):
            x, route, y = M.batch(ga * step + micro, rank, n_experts=2, random_routes=True)
            if rank == 1 and step == 1 and micro == ga - 1:
                if fail:
                    def oom(h, route):
                        raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                    model.moe.forward = oom
                    with pytest.raises(torch.OutOfMemoryError):
                        engine(x, route, y)
                    model.moe.forward = moe_forward
                x, route, y = x[:2], route[:2], y[:2]   # the retry, on half the batch
            engine.backward(engine(x, route, y))
            engine.step()
    return _weights(engine, model)


@pytest.mark.parametrize("stage, ga", [(0, 1), (1, 2), (2, 1)])
def test_a_forward_that_raised_and_was_retried_does_not_count(worlds, stage, ga):
    retried = worlds.run(2, _retried_forward, stage, True, ga)
    plain = worlds.run(2, _retried_forward, stage, False, ga)
    for rank in range(2):
        assert all(torch.equal(retried[rank][n], plain[rank][n]) for n in plain[rank]), rank
