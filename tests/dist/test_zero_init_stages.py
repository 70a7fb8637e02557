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
