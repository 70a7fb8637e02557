"""A model built under ``zero.Init`` and trained at stages 0-2 (a script whose config moved
off stage 3): initialize makes its parameters whole again, and training equals the same
model built plainly, bit for bit."""
import pytest
import torch

import reference as R


def _plain_vs_zero_init(rank, world, stage):
    import zerotrain
    trained = {}
    for how in ("plain", "zero.Init"):
        torch.manual_seed(0)
        if how == "plain":
            model = R.TinyNet()
        else:
            with zerotrain.zero.Init():
                model = R.TinyNet()
            assert all(p.numel() == 0 for p in model.parameters())
        engine, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=stage))
        R.train_engine(engine, steps=3, rank=rank, ga=1)
        trained[how] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return R.max_diff(trained["plain"], trained["zero.Init"])


@pytest.mark.parametrize("stage,world", [(0, 2), (1, 3), (2, 2)])
def test_zero_init_model_at_stages_0_to_2_trains_like_plain_construction(worlds, stage, world):
    assert worlds.run(world, _plain_vs_zero_init, stage) == [0.0] * world


def _skip_init_job(rank, world):
    """``torch.nn.utils.skip_init`` under ``zero.Init``: the module is built on the meta
    device and given memory by ``to_empty``; it is partitioned after that, as zeros (Note
    "skip_init's memory" in ``zero_init.py``), whatever that memory held: here NaN on
    every rank and other garbage on rank 1."""
    import zerotrain

    real = torch.empty_like

    def leftover(*args, **kwargs):   # what memory to_empty gets may hold
        out = real(*args, **kwargs)
        return out.fill_(float("nan") if rank == 0 else 3e38) if out.is_floating_point() else out

    torch.empty_like = leftover
    try:
        with zerotrain.zero.Init():
            linear = torch.nn.utils.skip_init(torch.nn.Linear, 7, 5)
    finally:
        torch.empty_like = real
    weight = linear.weight
    chunked = (weight.numel(), weight.ds_tensor.numel(), weight.ds_tensor.device.type)
    with zerotrain.zero.GatheredParameters(list(linear.parameters())):
        full = [p.detach().clone() for p in linear.parameters()]
    return chunked, tuple(full[0].shape), all(not p.any() for p in full)


def test_skip_init_module_is_partitioned_after_to_empty_as_zeros(worlds):
    assert worlds.run(2, _skip_init_job) == [((0, 18, "cpu"), (5, 7), True)] * 2


def _group_job(rank, world):
    """``zero.Init(data_parallel_group=...)`` over a group of its own: every rank keeps its
    chunk of rank 0's values (rank 0 of the group, a global rank the broadcast is told)."""
    import torch.distributed as dist
    import zerotrain

    group = dist.new_group(list(range(world)))
    torch.manual_seed(rank)   # each rank builds other values; rank 0's are broadcast
    with zerotrain.zero.Init(data_parallel_group=group):
        linear = torch.nn.Linear(3, 4)
    with zerotrain.zero.GatheredParameters([linear.weight]):
        return linear.weight.detach().clone()


def test_zero_init_over_a_data_parallel_group_keeps_rank_0s_values(worlds):
    torch.manual_seed(0)
    expected = torch.nn.Linear(3, 4).weight.detach()
    for weight in worlds.run(2, _group_job):
        assert torch.equal(weight, expected)
