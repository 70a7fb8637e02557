"""What DeepSpeed's stage-3 tests do by hand, done for real: a rank's chunk written through
``param.ds_tensor`` (rebinding ``.data``, ``.data.copy_``, ``.copy_``) reaches the next
gather and the fp32 master; ``optimizer.get_fp32_grad_partitions()``; backwards without a
step accumulate; ``optimizer.zero_grad()`` and a direct ``optimizer.step()`` equal
``engine.step()`` bit for bit, and the misuses that would train wrong are refused."""
import pytest
import torch

import reference as R

WRITES = ("rebind", "data_copy", "copy")


def _write(param, form, value):
    if form == "rebind":
        param.ds_tensor.data = torch.full_like(param.ds_tensor.data, value)
    elif form == "data_copy":
        param.ds_tensor.data.copy_(torch.full_like(param.ds_tensor, value))
    else:
        param.ds_tensor.copy_(torch.full_like(param.ds_tensor, value))


def _gathered_in_forward(engine, modules, x, y):
    """The weight each of ``modules`` sees in a forward (its unit's gather)."""
    seen, handles = {}, []
    for name, module in modules.items():
        def keep(m, args, name=name):
            seen[name] = m.weight.detach().float().clone()
        handles.append(module.register_forward_pre_hook(keep))   # after the stage's gather
    engine(x, y)
    for handle in handles:
        handle.remove()
    return seen


def _value(form, rank):
    return 0.5 * (rank + 1) + WRITES.index(form)


def _writes(rank, world):
    import zerotrain
    out = {}
    for precision in ("fp32", "bf16"):
        model = R.make_model()
        config = R.engine_config(stage=3, lr=0.0, precision=precision)
        engine, *_ = zerotrain.initialize(model=model, config=config)
        # one form each; inp and hidden are units of their own, out is in the root's
        modules = dict(zip(WRITES, (model.inp, model.hidden, model.out)))
        for form, module in modules.items():
            _write(module.weight, form, _value(form, rank))
        x, y = R.micro_batch(0, rank, 0)
        seen = _gathered_in_forward(engine, modules, x, y)
        engine.settle()                                    # the masters take them
        masters = {f: m.weight.ds_master.clone() for f, m in modules.items()}
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()                                      # lr 0: the values stay
        after = _gathered_in_forward(engine, modules, x, y)
        out[precision] = (seen, masters, after)
        bad = {}
        for wrong in (torch.zeros(3), torch.zeros_like(model.hidden.weight.ds_tensor,
                                                        dtype=torch.float64)):
            try:
                model.hidden.weight.ds_tensor.data = wrong
                bad[str(wrong.dtype) + str(wrong.numel())] = "no error"
            except ValueError as exc:
                bad[str(wrong.dtype) + str(wrong.numel())] = str(exc)
        out[precision + " bad"] = bad
        engine.destroy()
    return out


@pytest.mark.slow
def test_writes_through_ds_tensor_reach_the_gather_and_the_master(worlds):
    results = worlds.run(2, _writes)
    for rank, out in enumerate(results):
        for precision in ("fp32", "bf16"):
            seen, masters, after = out[precision]
            for form in WRITES:
                shape = seen[form].shape
                numel = shape.numel()
                chunk = -(-numel // 2)
                expected = torch.cat([torch.full((chunk,), _value(form, 0)),
                                      torch.full((numel - chunk,), _value(form, 1))])
                assert torch.equal(seen[form], expected.view(shape)), (precision, form)
                assert torch.equal(masters[form], torch.full((chunk,), _value(form, rank))), \
                    (precision, form)
                assert torch.equal(after[form], expected.view(shape)), (precision, form)
            bad = out[precision + " bad"]
            assert "'hidden.weight'" in bad["torch.float323"]
            assert "189 elements" in bad["torch.float323"]   # ceil(29 * 13 / 2)
            assert "torch.float64" in bad["torch.float64189"]


def _direct_steps(rank, world, stage, precision, direct, backwards, zero_grad):
    """``backwards`` engine.backward calls per update (gradient_accumulation_steps
    ``backwards``), then optimizer.step() (``direct``) or an engine.step() after each."""
    import zerotrain
    model = R.make_model()
    config = R.engine_config(stage=stage, ga=backwards, precision=precision, clip=0.05)
    engine, optimizer, *_ = zerotrain.initialize(model=model, config=config)
    norms = []
    for step in range(2):
        for micro in range(backwards):
            engine.backward(engine(*R.micro_batch(step, rank, micro)))
            if not direct:
                engine.step()
        if direct:
            if zero_grad:
                optimizer.zero_grad()   # as in DeepSpeed: the step still uses them
            optimizer.step()
        norms.append(engine.get_global_grad_norm())
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return weights, norms


def _refusals(rank, world):
    import zerotrain
    from zerotrain.errors import StateError
    out = {}

    def attempt(name, *calls):
        try:
            for call in calls:
                call()
            out[name] = "no error"
        except StateError as exc:
            out[name] = str(exc)

    for stage in (1, 3):
        model = R.make_model()
        engine, optimizer, *_ = zerotrain.initialize(
            model=model, config=R.engine_config(stage=stage, ga=2))
        batch = R.micro_batch(0, rank, 0)
        attempt((stage, "no backward"), optimizer.step)
        backward = lambda: engine.backward(engine(*batch))   # noqa: E731
        attempt((stage, "mid window"), backward, optimizer.step)
        engine.zero_grad()
        if stage == 3:   # not at a boundary: engine.step() would only count a micro step
            attempt((stage, "twice mid window"), backward, optimizer.step, engine.step)
            engine.zero_grad()
        attempt((stage, "counted window"), backward, engine.step, backward, optimizer.step)
        attempt((stage, "zero_grad mid window"), optimizer.zero_grad)
        engine.zero_grad()
        engine.set_gradient_accumulation_boundary(True)
        attempt((stage, "twice"), backward, optimizer.step, engine.step)
        engine.destroy()
    return out


def _accumulate(rank, world):
    import zerotrain
    model = R.make_model()
    engine, optimizer, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=3))
    batch = R.micro_batch(0, rank, 0)
    seen = []
    for _ in range(3):
        engine.backward(engine(*batch))
        seen.append(optimizer.get_fp32_grad_partitions())
    optimizer.zero_grad()
    engine.backward(engine(*batch))
    seen.append(optimizer.get_fp32_grad_partitions())
    engine.destroy()
    return seen


def _compare(rank, world):
    out = {}
    for stage in (1, 2, 3):
        for precision in ("fp32", "fp16"):
            engine_path = _direct_steps(rank, world, stage, precision, False, 1, False)
            direct = _direct_steps(rank, world, stage, precision, True, 1, False)
            out[(stage, precision, 1)] = (engine_path, direct)
    for precision in ("fp32", "bf16"):   # three backwards, one update (stage 3)
        engine_path = _direct_steps(rank, world, 3, precision, False, 3, False)
        direct = _direct_steps(rank, world, 3, precision, True, 3, True)
        out[(3, precision, 3)] = (engine_path, direct)
    out["refusals"] = _refusals(rank, world)
    out["accumulated"] = _accumulate(rank, world)
    return out


@pytest.mark.slow
def test_optimizer_step_after_backwards_equals_engine_step_bitwise(worlds):
    for result in worlds.run(2, _compare):
        refusals = result.pop("refusals")
        seen = result.pop("accumulated")
        for key, (managed, direct) in result.items():
            assert direct[1] == managed[1], key
            for name, value in managed[0].items():
                assert torch.equal(direct[0][name], value), (key, name)
        for stage in (1, 3):
            assert "without any engine.backward" in refusals[(stage, "no backward")]
            assert "optimizer.step() already took" in refusals[(stage, "twice")]
            assert "middle of an accumulation window" in refusals[(stage, "counted window")]
        assert "does not end the accumulation window" in refusals[(1, "mid window")]
        assert "would drop the gradients of its first 1" in refusals[(1, "zero_grad mid window")]
        assert refusals[(3, "mid window")] == "no error"   # stage 3 reduces every backward
        assert "optimizer.step() already took" in refusals[(3, "twice mid window")]
        # backwards without a step accumulate; optimizer.zero_grad() starts the next afresh
        first = seen[0][0]
        assert set(seen[0]) == {0} and set(first) == set(range(8))   # TinyNet: 8 tensors
        assert all(c.dtype == torch.float32 for c in first.values())
        for times, partitions in ((2, seen[1]), (3, seen[2]), (1, seen[3])):
            for index, chunk in first.items():
                torch.testing.assert_close(partitions[0][index], times * chunk)
