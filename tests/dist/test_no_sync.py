"""``engine.no_sync()``: gradients kept local at stages 0-1, reduced by the window's next
backward outside it; refused at stages 2-3, as in DeepSpeed.

At world size 2 the rank sum has a single rounding, so an exact engine matches the
rank-order reference (tests/reference.py) bit for bit; with no_sync it must still do so,
and equal the same loop without no_sync.
"""
import pytest

import reference as R

STEPS, GA = 2, 3


def _params(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _engine(stage: int, ga: int, overlap: bool):
    import zerotrain
    engine, *_ = zerotrain.initialize(model=R.make_model(),
                                      config=R.engine_config(stage=stage, ga=ga, overlap=overlap))
    return engine


def _quiet(engine) -> bool:
    """Whether no collective ran since the last call of communication_breakdown()."""
    moved = engine.communication_breakdown()
    return not any(v for k, v in moved.items() if k != "steps")


def _loops(rank, world, stage, overlap):
    """One stage: the plain loop, the same loop with all but each window's last micro-step
    inside no_sync (backward and step), and a Megatron-style loop (one accumulation step in
    the config, several backwards per step, all but the last inside no_sync)."""
    import contextlib

    import torch
    plain = _engine(stage, GA, overlap)
    R.train_engine(plain, steps=STEPS, rank=rank, ga=GA)

    wrapped = _engine(stage, GA, overlap)
    for step in range(STEPS):
        for micro in range(GA):
            last = micro == GA - 1
            with wrapped.no_sync() if not last else contextlib.nullcontext():
                wrapped.backward(wrapped(*R.micro_batch(step, rank, micro)))
                wrapped.step()

    megatron = _engine(stage, 1, overlap)
    quiet = []
    for step in range(STEPS):
        megatron.communication_breakdown()
        with megatron.no_sync():
            for micro in range(GA - 1):   # each of these is at the boundary (one GA step)
                megatron.backward(megatron(*R.micro_batch(step, rank, micro)) / GA)
        quiet.append(_quiet(megatron))
        megatron.backward(megatron(*R.micro_batch(step, rank, GA - 1)) / GA)
        megatron.step()
        quiet.append(not _quiet(megatron))   # the reduction did run, after no_sync
    reference = R.reference_accumulate(steps=STEPS, world=world, ga=GA)
    runs = {"plain": _params(plain), "wrapped": _params(wrapped),
            "megatron": _params(megatron)}
    return {"same_as_plain": {k: all(torch.equal(v[n], runs["plain"][n]) for n in v)
                              for k, v in runs.items()},
            "vs_reference": {k: R.max_diff(v, reference) for k, v in runs.items()},
            "steps": (wrapped.global_steps, wrapped.micro_steps, megatron.global_steps),
            "quiet": quiet}


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_keeps_gradients_local_and_the_result_is_bit_for_bit_unchanged(worlds,
                                                                                stage):
    for overlap in (False, True):
        for rank, res in enumerate(worlds.run(2, _loops, stage, overlap)):
            where = (stage, overlap, rank, res)
            assert res["same_as_plain"] == {"plain": True, "wrapped": True,
                                            "megatron": True}, where
            assert res["vs_reference"] == {"plain": 0.0, "wrapped": 0.0,
                                           "megatron": 0.0}, where
            assert res["steps"] == (STEPS, STEPS * GA, STEPS), where
            assert all(res["quiet"]), where   # nothing crossed the wire inside no_sync


def _refusals(rank, world):
    import torch
    from zerotrain.errors import StateError
    out = {}
    for stage in (2, 3):
        engine = _engine(stage, 1, False)
        try:
            with engine.no_sync():
                out[stage] = None
        except StateError as exc:
            out[stage] = str(exc)
        out[f"{stage}_after"] = engine.inside_no_sync_ctxt   # state restored
        engine.backward(engine(*R.micro_batch(0, rank, 0)))
        engine.step()                    # and the engine trains on
    engine = _engine(1, 2, False)
    before = _params(engine)
    with engine.no_sync():
        engine.backward(engine(*R.micro_batch(0, rank, 0)))
        engine.step()                    # not a boundary: only counts the micro-step
        engine.backward(engine(*R.micro_batch(0, rank, 1)))
        try:
            engine.step()                # the boundary, inside no_sync
        except StateError as exc:
            out["inside"] = str(exc)
    try:
        engine.step()                    # outside, but no backward outside since
    except StateError as exc:
        out["after"] = str(exc)
    out["unchanged"] = (all(torch.equal(v, p) for v, p in zip(before.values(),
                                                                 _params(engine).values()))
                        and (engine.global_steps, engine.micro_steps) == (0, 1))
    engine.zero_grad()                   # drop the window's gradients; still at its boundary
    with engine.no_sync():
        with engine.no_sync():           # nested: leaving the inner keeps the outer
            engine.backward(engine(*R.micro_batch(0, rank, 0)))   # at the boundary: local
        out["nested_outer"] = engine.inside_no_sync_ctxt
    out["nested_done"] = engine.inside_no_sync_ctxt
    try:
        with engine.no_sync():
            raise KeyError("raised inside no_sync")
    except KeyError:
        out["after_exception"] = engine.inside_no_sync_ctxt
    engine.backward(engine(*R.micro_batch(0, rank, 1)))
    engine.step()
    out["recovered"] = R.max_diff(_params(engine), R.reference_accumulate(steps=1, world=world,
                                                                          ga=2))
    once = _engine(0, 1, False)          # a reduced boundary, then a no_sync backward
    once.backward(once(*R.micro_batch(0, rank, 0)))
    try:
        with once.no_sync():
            once.backward(once(*R.micro_batch(0, rank, 1)))
    except StateError as exc:
        out["late"] = str(exc)
    return out


def test_no_sync_refuses_what_it_cannot_do_exactly_and_restores_its_state(worlds):
    for res in worlds.run(2, _refusals):
        for stage in (2, 3):
            assert f"ZeRO stage {stage}" in res[stage] and "partitions gradients" in res[
                stage], res
            assert res[f"{stage}_after"] is False, res
        assert "inside engine.no_sync()" in res["inside"] and "not reduced" in res["inside"]
        assert "after 2 backward(s) inside engine.no_sync()" in res["after"], res
        assert res["unchanged"], res
        assert res["nested_outer"] is True and res["nested_done"] is False, res
        assert res["after_exception"] is False, res
        assert res["recovered"] == 0.0, res
        assert "already reduced" in res["late"] and "engine.step() first" in res["late"], res
