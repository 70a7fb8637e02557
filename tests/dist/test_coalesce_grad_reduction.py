"""``engine.coalesce_grad_reduction()`` (DeepSpeed 0.19), on 2 gloo ranks: backwards inside
keep their gradients local, leaving the block reduces them once, and the steps equal those
of the same backwards without the block."""
import contextlib

import pytest
import torch


def _job(rank: int, world: int, stage: int, coalesce: bool) -> list[torch.Tensor]:
    import zerotrain
    from zerotrain.errors import StateError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    engine, *_ = zerotrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    assert engine._is_gradient_accumulation_boundary is None   # the engine counts
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(2):
        with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
            for i in range(3):
                engine.set_gradient_accumulation_boundary(i == 2)
                engine.backward(engine(torch.randn(2, 6, generator=g)).square().mean())
                if coalesce and i == 2:   # a StateError, and DeepSpeed's AssertionError
                    with pytest.raises(StateError, match="inside coalesce"):
                        engine.step()
                    with pytest.raises(AssertionError, match="no_sync"):
                        engine.step()
        engine.step()
    assert engine._is_gradient_accumulation_boundary is True   # the caller's last choice
    out = [p.detach().clone() for p in model.parameters()]
    if stage == 1:
        with engine.no_sync():
            with pytest.raises(StateError, match="nested"):
                with engine.coalesce_grad_reduction():
                    pass
            with pytest.raises(AssertionError, match="nested"):
                with engine.coalesce_grad_reduction():
                    pass
        with engine.coalesce_grad_reduction():   # and the reverse, as DeepSpeed refuses it
            with pytest.raises(AssertionError, match="no_sync"):
                with engine.no_sync():
                    pass
            assert engine.inside_no_sync_ctxt   # the block's state is untouched
    else:
        with pytest.raises(AssertionError, match="ZeRO stage 2"):
            with engine.no_sync():
                pass
    assert engine.pipeline_parallelism is False
    engine.pipeline_parallelism = True
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        with engine.coalesce_grad_reduction():
            pass
    engine.close()
    return out


def _stage0_job(rank: int, world: int) -> bool:
    import zerotrain

    engine, *_ = zerotrain.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 2 * world, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with pytest.raises(NotImplementedError, match="stage 1/2/3"):
        with engine.coalesce_grad_reduction():
            pass
    engine.close()
    # stage 1, bf16, grad_accum_dtype "fp32" written out: DeepSpeed's BF16_Optimizer, whose
    # block DeepSpeed refuses; without the key (fp32 all the same here) the block runs
    for accum in ("fp32", None):
        config = {"train_batch_size": 2 * world, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 1},
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        if accum:
            config["data_types"] = {"grad_accum_dtype": accum}
        engine, *_ = zerotrain.initialize(model=torch.nn.Linear(2, 2), config=config)
        block = engine.coalesce_grad_reduction()
        if accum:
            with pytest.raises(NotImplementedError, match="optimizer wrapper BF16_Optimizer"):
                block.__enter__()
        else:
            with block:
                engine.backward(engine(torch.ones(2, 2, dtype=torch.bfloat16)).sum())
            engine.step()
        engine.close()
    return True


@pytest.mark.parametrize("stage", [1, 2])
def test_a_coalesced_step_equals_the_plain_one(worlds, stage):
    plain = worlds.run(2, _job, stage, False)
    coalesced = worlds.run(2, _job, stage, True)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(plain[rank], coalesced[rank])), rank
    assert all(torch.equal(a, b) for a, b in zip(plain[0], plain[1]))


def test_stage_0_and_deepspeeds_bf16_optimizer_refuse_it_as_deepspeed(worlds):
    assert worlds.run(2, _stage0_job) == [True, True]
