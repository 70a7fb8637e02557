"""``managed_gradient_accumulation: false`` (DeepSpeed 0.19's unmanaged accumulation), on 2
gloo ranks: every ``step()`` ends the caller's window and applies an update, and N backwards
then one step equal the managed loop with ``gradient_accumulation_steps`` N bit for bit, at
stages 0-3; misuse and ranks that disagree raise, naming why."""
import logging

import pytest
import torch

import reference as R


def _params(engine):
    import zerotrain
    params = list(engine.module.parameters())
    with zerotrain.zero.GatheredParameters(params):   # whole at every stage
        return [p.detach().clone() for p in params]


def _train(rank, stage, offload, managed, counts, *, override=False, optimizer_step=False,
           plain_backward=False):
    """One engine through windows of ``counts[w]`` backwards; managed: ``step()`` after each
    backward (``override``: the caller marks each window's last backward), unmanaged: one
    ``step()`` (or ``optimizer.step()``) per window."""
    import zerotrain
    config = R.engine_config(stage=stage, ga=3)
    config["managed_gradient_accumulation"] = managed
    if offload:   # the host update takes gradients no boundary backward streamed down
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, optimizer, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    seen = []
    for w, n in enumerate(counts):
        for i in range(n):
            if override:
                engine.set_gradient_accumulation_boundary(i == n - 1)
            loss = engine(*R.micro_batch(w, rank, i))
            if plain_backward:   # torch's backward through the engine's outputs
                loss.backward()
            else:   # varying windows: the caller averages (as DeepSpeed's test does)
                engine.backward(loss / n if override or n != 3 else loss,
                                scale_wrt_gas=not (override or n != 3))
            if managed:
                engine.step()
            else:
                seen.append(engine.is_gradient_accumulation_boundary())
        if not managed:
            (optimizer.step if optimizer_step else engine.step)()
            seen.append((engine.was_step_applied(), engine.global_steps,
                         engine.global_samples, engine.micro_steps))
    out = _params(engine)
    engine.close()
    return out, seen


def _job(rank, world, stage, offload):
    managed, _ = _train(rank, stage, offload, True, [3, 3])
    unmanaged, seen = _train(rank, stage, offload, False, [3, 3])
    direct, _ = _train(rank, stage, offload, False, [3, 3], optimizer_step=True)
    # a plain loss.backward() is refused at stage 0, as in DeepSpeed (test_direct_backward.py)
    plain = (_train(rank, stage, offload, False, [3, 3], plain_backward=True)[0] if stage
             else managed)
    by_hand, _ = _train(rank, stage, offload, True, [1, 4], override=True)
    varying, _ = _train(rank, stage, offload, False, [1, 4])
    same = [all(torch.equal(a, b) for a, b in zip(managed, x)) for x in (unmanaged, direct,
                                                                         plain)]
    return same + [all(torch.equal(a, b) for a, b in zip(by_hand, varying)),
                   all(torch.equal(a, b) for a, b in zip(managed, by_hand)), seen]


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, False), (3, False),
                                           (1, True), (3, True)])
def test_unmanaged_windows_equal_the_managed_loop(worlds, stage, offload):
    for *same, differs, seen in worlds.run(2, _job, stage, offload):
        assert same == [True] * 4   # engine.step, optimizer.step, loss.backward, varying
        assert not differs   # other windows train to other weights: the check can fail
        micro = 4 * 2   # micro-batch of 4, 2 ranks: each backward counts 8 samples
        assert seen == [False] * 3 + [(True, 1, 3 * micro, 1)] + \
            [False] * 3 + [(True, 2, 6 * micro, 2)]


def _misuse(rank, world, stage, save_dir):
    import zerotrain
    from zerotrain.errors import RankDivergenceError, StateError

    config = R.engine_config(stage=stage, ga=2)
    config["managed_gradient_accumulation"] = False
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    assert not engine.managed_gradient_accumulation()
    with pytest.raises(AssertionError, match="set_gradient_accumulation_boundary"):
        engine.set_gradient_accumulation_boundary(True)
    if stage in (1, 2):
        with pytest.raises(AssertionError, match="coalesce_grad_reduction"):
            with engine.coalesce_grad_reduction():
                pass
    with pytest.raises(StateError, match="without any engine.backward"):
        engine.step()   # nothing to apply: never an update of zeros
    engine.backward(engine(*R.micro_batch(0, rank, 1)))
    with pytest.raises(StateError, match="only inside engine.step"):   # not reduced yet
        zerotrain.utils.safe_get_full_grad(next(engine.module.parameters()))
    if stage < 2:   # no_sync: allowed, the step reduces; a step inside it is refused
        with engine.no_sync():
            engine.backward(engine(*R.micro_batch(0, rank, 0)))
            with pytest.raises(StateError, match="inside engine.no_sync"):
                engine.step()
    engine.step()
    assert engine.was_step_applied() and engine.micro_steps == 1   # odd, gas 2: no window open
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("zerotrain").addHandler(handler)
    try:
        engine.save_checkpoint(save_dir, tag="t")
        engine.backward(engine(*R.micro_batch(0, rank, 2)))
        engine.save_checkpoint(save_dir, tag="t")
    finally:
        logging.getLogger("zerotrain").removeHandler(handler)
    assert [m for m in warned if "middle of gradient accumulation" in m] == \
        ["saving in the middle of gradient accumulation (micro step 1): the gradients "
         "accumulated so far are not saved"]
    engine.step()
    # rank 1 runs one backward more: at stage 2 its third backward meets rank 0's step
    with pytest.raises(RankDivergenceError, match=r"rank 0: an update after 2 backward\(s\); "
                       r"rank 1: (an update after 3 backward\(s\)|backward 3)"):
        for i in range(2 + rank):
            engine.backward(engine(*R.micro_batch(1, rank, i)))
        engine.step()
    engine.close()
    return True


@pytest.mark.parametrize("stage", [0, 2])
def test_unmanaged_misuse_and_diverging_ranks_raise(worlds, stage, tmp_path):
    assert worlds.run(2, _misuse, stage, str(tmp_path)) == [True, True]
