"""``loss.backward()`` then ``engine.step()`` trains exactly like ``engine.backward(loss)``
(DeepSpeed accepts it since 0.18): at stages 1-3, in fp32, and in fp16 with the loss scaled
by ``engine.scale(loss)`` as DeepSpeed documents; the engine divides by the accumulation
steps itself. At stage 0 it is refused before any gradient exists, as DeepSpeed refuses
it there, and training through ``engine.backward`` goes on unchanged."""
import pytest
import torch

import reference as R

STEPS, GA = 3, 2


def _train(rank, world, stage, precision, direct):
    import zerotrain
    model = R.make_model()
    config = R.engine_config(stage=stage, ga=GA, precision=precision, clip=1.0)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    if direct == "refused":   # stage 0: refused at once, nothing of it left behind
        with pytest.raises(RuntimeError, match="Direct calls to tensor.backward"):
            engine(*R.micro_batch(0, rank, 0)).backward()
        direct = False
    for step in range(STEPS):
        for micro in range(GA):
            loss = engine(*R.micro_batch(step, rank, micro))
            if direct:   # fp16: DeepSpeed's documented engine.scale(loss).backward()
                (engine.scale(loss) if precision == "fp16" else loss).backward()
            else:
                engine.backward(loss)
            engine.step()
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return weights, engine.global_steps, engine.get_global_grad_norm()


def _compare(rank, world):
    out = {}
    for stage in (0, 1, 2, 3):
        for precision in (("fp32", "fp16") if stage == 1 else ("fp32",)):
            managed = _train(rank, world, stage, precision, direct=False)
            direct = _train(rank, world, stage, precision,
                            direct="refused" if stage == 0 else True)
            out[(stage, precision)] = (managed, direct)
    return out


@pytest.mark.slow
def test_plain_loss_backward_then_step_matches_engine_backward_at_every_stage(worlds):
    for result in worlds.run(2, _compare):
        for key, (managed, direct) in result.items():
            assert direct[1] == managed[1] == STEPS, key
            assert direct[2] == managed[2], key
            for name, value in managed[0].items():
                assert torch.equal(direct[0][name], value), (key, name)


def _without_engine_backward(rank, world):
    import zerotrain
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=R.engine_config(stage=2, ga=GA))
    try:
        engine.step()
        engine.step()
    except zerotrain.errors.StateError as exc:
        return str(exc)
    return "no error"


def test_step_without_any_backward_still_names_both_ways(worlds):
    for message in worlds.run(2, _without_engine_backward):
        assert "engine.backward(loss) or loss.backward()" in message


def _failing(rank, world, stage, direct, fail_ranks, steps=3):
    """Train ``steps`` steps; at step 1 the backward of ``fail_ranks`` raises inside the
    model (after the engine's gate), the script catches it and goes on with the step.
    Returns each step's outcome and, when every step passed, the final weights."""
    import zerotrain
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=R.engine_config(stage=stage, comms_timeout=20))
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    fail = {"now": False}
    first.register_forward_hook(lambda m, i, o: R.RaiseInBackward.apply(o) if fail["now"] else o)
    outcome = []
    for step in range(steps):
        fail["now"] = step == 1 and rank in fail_ranks
        try:
            loss = engine(*R.micro_batch(step, rank, 0))
            try:
                loss.backward() if direct else engine.backward(loss)
            except RuntimeError as exc:
                if "injected" not in str(exc):
                    raise
            engine.step()
            outcome.append("ok")
        except Exception as exc:   # noqa: BLE001 - the error is the result
            outcome.append(f"{type(exc).__name__}: {exc}")
            break
    weights = None
    if outcome == ["ok"] * steps:
        with zerotrain.zero.GatheredParameters(list(model.parameters())):
            weights = [p.detach().clone() for p in model.parameters()]
    engine.destroy()
    return outcome, weights


def _failed_backwards(rank, world):
    return {(stage, fail): [_failing(rank, world, stage, direct, fail) for direct in (False, True)]
            for stage in (1, 2, 3) for fail in ((0, 1), (1,))}


def test_a_direct_backward_that_raises_ends_as_engine_backward_ends_a_failed_one(worlds):
    """Before, a ``loss.backward()`` that raised left the engine mid-backward (autograd
    drops the epilogue it queued): each later backward failed with a misleading StateError,
    and a peer whose backward went through waited out ``comms_timeout``."""
    for result in worlds.run(2, _failed_backwards):
        for (stage, fail), (managed, direct) in result.items():
            if fail == (0, 1):   # every rank failed alike: training goes on, as managed
                assert managed[0] == direct[0] == ["ok"] * 3, (stage, managed[0], direct[0])
                for a, b in zip(managed[1], direct[1]):
                    assert torch.equal(a, b), stage
            else:   # one rank: a named divergence on every rank, no timeout
                assert "RankDivergenceError" in direct[0][-1], (stage, direct[0])
                assert len(direct[0]) <= 3, (stage, direct[0])
