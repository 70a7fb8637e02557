"""``zero.TiledLinear`` at stage 3: built under ``zero.Init`` from a full layer, its tiles
are partitioned, rank 0's values are the ones copied in, and the engine's forward equals
the untiled layer's."""
import torch


def _tiled_under_zero_init(rank, world):
    import zerotrain
    torch.manual_seed(0)
    base = torch.nn.Linear(11, 9)
    if rank == 1:   # rank 0's layer is the one copied into the tiles
        torch.nn.init.zeros_(base.weight)
    with zerotrain.zero.Init():
        tiled = zerotrain.zero.TiledLinear(11, 9, in_splits=3, out_splits=2, init_linear=base)
    if rank == 1:
        torch.manual_seed(0)
        base = torch.nn.Linear(11, 9)
    assert all(p.numel() == 0 for p in tiled.parameters())
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerotrain.initialize(model=tiled, config=config)
    x = torch.randn(2, 11, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        return (engine(x) - base(x)).abs().max().item()


def test_tiled_linear_built_under_zero_init_equals_the_full_layer(worlds):
    assert max(worlds.run(2, _tiled_under_zero_init)) < 1e-6
