"""``engine.coalesce_grad_reduction()`` (DeepSpeed 0.19), on 2 gloo ranks: backwards inside
keep their gradients local, leaving the block reduces them once, and the steps equal those
of the same backwards without the block."""
import contextlib

import pytest
import torch


WINDOW = 4   # backwards per window: the loss divided by 4 stays exact


def _exact_model(rank):
    """Weights in eighths and integer inputs: every gradient, and every sum of them over
    backwards and ranks, is exact in fp32, so holding the backwards (their sums added in
    another order: Note "held backwards" in stages/buckets.py) must change no bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-4, 5, p.shape) / 8)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(-3, 4, (2, 6), generator=g).float() for _ in range(2 * WINDOW)]
    return model, batches


def _job(rank: int, world: int, stage: int, coalesce: bool, fp16_offload: bool = False):
    import zerotrain
    from zerotrain.errors import StateError
    from zerotrain.utils import safe_get_full_grad

    model, batches = _exact_model(rank)
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": WINDOW,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 24,
                              "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 24},
        "optimizer": {"type": "SGD", "params": {"lr": 0.125}}}
    if fp16_offload:   # rank 0's second backward overflows: the first window is skipped
        config["fp16"] = {"enabled": True, "initial_scale_power": 9, "hysteresis": 1}
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        batches = [b.half() for b in batches]
    engine, *_ = zerotrain.initialize(model=model, config=config)
    assert engine._is_gradient_accumulation_boundary is None   # the engine counts
    flushes, micro_step_ids = [], []
    if stage == 3:   # DeepSpeed's flush, called through the instance (a spy sees it)
        flush = engine._flush_coalesced_reduction_zero3

        def spy(optimizer):
            flushes.append(optimizer.micro_step_id)
            flush(optimizer)
            flushes.append(optimizer.micro_step_id)
        engine._flush_coalesced_reduction_zero3 = spy
    reduce_scatters, grads = [], []
    for window in range(2):
        engine.comm.ledger.reset()
        with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
            for i in range(WINDOW):
                engine.set_gradient_accumulation_boundary(i == WINDOW - 1)
                loss = engine(batches[window * WINDOW + i]).sum()
                if fp16_offload and window == 0 and i == 1 and rank == 0:
                    loss = loss * float("inf")
                engine.backward(loss)
                if stage == 3:
                    micro_step_ids.append(engine.optimizer.micro_step_id)
                if coalesce and i == WINDOW - 1:   # a StateError, and DeepSpeed's AssertionError
                    with pytest.raises(StateError, match="inside coalesce"):
                        engine.step()
                    with pytest.raises(AssertionError, match="no_sync"):
                        engine.step()
                    with pytest.raises(StateError, match="inside coalesce"):   # local only
                        safe_get_full_grad(next(model.parameters()))
        grads.append(safe_get_full_grad(next(model.parameters())))   # reduced: the exit's
        engine.step()   # stage 1 without overlap_comm reduces here
        reduce_scatters.append(engine.comm.ledger.snapshot()["calls"].get("reduce_scatter", 0))
        if stage == 3:
            micro_step_ids.append(engine.optimizer.micro_step_id)
    assert engine._is_gradient_accumulation_boundary is True   # the caller's last choice
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        out = [p.detach().clone() for p in model.parameters()] + grads
    if fp16_offload:
        skipped = (engine.skipped_steps, engine.loss_scale)
        engine.close()
        return out, reduce_scatters, skipped
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
        with pytest.raises(AssertionError, match=f"ZeRO stage {stage}"):
            with engine.no_sync():
                pass
    blocks = sum(len(r.layout.blocks) for r in engine.stage.shard_records())
    assert engine.pipeline_parallelism is False
    engine.pipeline_parallelism = True
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        with engine.coalesce_grad_reduction():
            pass
    engine.close()
    return out, reduce_scatters, blocks, flushes, micro_step_ids


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


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_coalesced_step_equals_the_plain_one(worlds, stage):
    """Equal bit for bit; at stages 2 and 3 a window of 4 backwards in the block issues
    the reduce-scatters of one backward (one per bucket), where the plain loop issues 4
    times as many; stage 1 issues one backward's either way (at the boundary)."""
    plain = worlds.run(2, _job, stage, False)
    coalesced = worlds.run(2, _job, stage, True)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(plain[rank][0], coalesced[rank][0])), rank
        blocks = plain[rank][2]
        assert blocks > 1   # several buckets (reduce_bucket_size, stage 3's units)
        assert coalesced[rank][1] == [blocks, blocks], (rank, coalesced[rank][1])
        assert plain[rank][1] == [blocks * (1 if stage == 1 else WINDOW)] * 2, plain[rank][1]
    assert all(torch.equal(a, b) for a, b in zip(plain[0][0], plain[1][0]))
    if stage == 3:   # DeepSpeed's optimizer.micro_step_id: reductions since the update
        assert coalesced[0][3] == [0, 1, 0, 1]   # around each flush
        assert coalesced[0][4] == [0] * WINDOW + [0] + [0] * WINDOW + [0]
        assert plain[0][4] == [1, 2, 3, 4, 0] * 2


def test_stage_0_and_deepspeeds_bf16_optimizer_refuse_it_as_deepspeed(worlds):
    assert worlds.run(2, _stage0_job) == [True, True]


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_loss_scaling_and_optimizer_offload_inside_the_block(worlds, stage):
    """fp16 with a dynamic loss scale and the optimizer on the host: an overflow inside the
    block is found at the step as in the plain loop (skipped, the scale lowered), and the
    next window updates as it does; the block still reduces once."""
    plain = worlds.run(2, _job, stage, False, True)
    coalesced = worlds.run(2, _job, stage, True, True)
    for rank in range(2):
        (p, p_rs, p_skip), (c, c_rs, c_skip) = plain[rank], coalesced[rank]
        assert p_skip == c_skip and p_skip[0] == 1, (p_skip, c_skip)
        assert c_rs[0] > 0 and p_rs == [WINDOW * c_rs[0]] * 2 and c_rs == [c_rs[0]] * 2
        moved = [not torch.equal(a, b) for a, b in zip(p, _exact_model(rank)[0].parameters())]
        assert any(moved)   # the second window updated
        # fp16 wire: its rounding may differ with the sums' order; the skipped window's
        # gradient is non-finite in both
        for a, b in zip(p, c):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-3, equal_nan=True)


def _one_rank_job(rank: int, world: int, holders: tuple, votes: bool, overlap: bool):
    """Stage 1, ranks in ``holders`` run each window's backwards inside the block, the
    others without it: the same collectives either way (one reduction per window)."""
    import zerotrain

    model, batches = _exact_model(rank)
    engine, *_ = zerotrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": WINDOW,
        "backward_votes": votes,
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 24, "overlap_comm": overlap},
        "optimizer": {"type": "SGD", "params": {"lr": 0.125}}})
    for window in range(2):
        held = rank in holders
        with engine.coalesce_grad_reduction() if held else contextlib.nullcontext():
            for i in range(WINDOW):
                engine.set_gradient_accumulation_boundary(i == WINDOW - 1)
                engine.backward(engine(batches[window * WINDOW + i]).sum())
        engine.step()
    out = [p.detach().clone() for p in model.parameters()]
    engine.close()
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_stage1_block_on_one_rank_only_trains_as_if_all_had(worlds, overlap):
    """docs/divergence.md: at stage 1 the block changes no collective, so one rank using it
    alone trains bit for bit as when every rank does, with the backward votes on (they
    took the block's exit for a missing backward) as with them off."""
    every = worlds.run(2, _one_rank_job, (0, 1), True, overlap)
    for votes in (True, False):
        alone = worlds.run(2, _one_rank_job, (1,), votes, overlap)
        for rank in range(2):
            assert all(torch.equal(a, b) for a, b in zip(every[rank], alone[rank])), (votes, rank)
