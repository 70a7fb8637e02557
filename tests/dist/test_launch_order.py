"""Collectives launched from autograd hooks go out in the same order on every rank, even
when the hooks fire in different orders (Note "launch order" in buckets.py).

Here the two ranks build the same two-branch graph in opposite orders, and one branch runs
a CPU-side op in backward (a host round trip through NumPy, as a backward node on a CPU
thread would): gradients then arrive in a different order on each rank. The sequence of
collectives must still be identical, and training must give the same weights as when both
ranks build the graph the same way.
"""
import torch
from torch import nn

import reference as R


class HostRoundTrip(torch.autograd.Function):
    """Identity whose backward goes through host memory (NumPy), off the autograd device."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.from_numpy(grad.detach().cpu().numpy().copy()).to(grad.device)


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(R.IN, 5)
        self.b = nn.Linear(R.IN, 6)
        self.head = nn.Linear(11, R.OUT)
        self.a_first = True

    def forward(self, x, y):
        # autograd runs later-created nodes first: the build order sets the hook order
        if self.a_first:
            ha = torch.tanh(self.a(x))
            hb = HostRoundTrip.apply(torch.tanh(self.b(x)))
        else:
            hb = HostRoundTrip.apply(torch.tanh(self.b(x)))
            ha = torch.tanh(self.a(x))
        return nn.functional.mse_loss(self.head(torch.cat([ha, hb], dim=1)), y)


def _train(rank, stage, overlap, flip):
    import zerotrain
    torch.manual_seed(0)
    model = TwoBranches()
    model.a_first = not (flip and rank == 1)
    config = R.engine_config(stage=stage, ga=2, bucket=8, overlap=overlap)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    launched, arrived = [], []
    buckets = engine.stage.buckets
    # the buckets hold their reduce-scatter (a plug-in at stage 3); the rest is comm's
    for owner, op in ((engine.comm, "all_reduce"), (engine.comm, "all_gather"),
                      (engine.stage.comm, "all_gather"),
                      (engine.stage.comm, "all_gather_into_many"),
                      (buckets, "reduce_scatter")):
        def wrapper(*args, _call=getattr(owner, op), _op=op, **kwargs):
            launched.append((_op, kwargs.get("label", "")))
            return _call(*args, **kwargs)
        if not getattr(getattr(owner, op), "spied", False):
            wrapper.spied = True
            setattr(owner, op, wrapper)
    add = buckets.add

    def spy(g, index, grad):
        arrived.append((g, index))
        return add(g, index, grad)
    buckets.add = spy
    R.train_engine(engine, steps=2, rank=rank, ga=2)
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return {"launched": launched, "arrived": arrived, "weights": weights}


def _grid(rank, world):
    out = {}
    for stage, overlap in ((2, True), (2, False), (3, True)):
        out[(stage, overlap)] = (_train(rank, stage, overlap, flip=True),
                                 _train(rank, stage, overlap, flip=False))
    return out


def test_hooks_in_rank_dependent_order_launch_collectives_in_one_order(worlds):
    per_rank = worlds.run(2, _grid)
    for case in per_rank[0]:
        (flip0, same0), (flip1, same1) = per_rank[0][case], per_rank[1][case]
        assert flip0["arrived"] != flip1["arrived"], f"{case}: the hook orders must differ"
        assert flip0["launched"] == flip1["launched"], case
        assert any(label.startswith("gradient bucket") for _, label in flip0["launched"])
        if case[0] == 3:   # the units' gathers are among the launches compared
            assert any(op == "all_gather_into_many" for op, _ in flip0["launched"])
        for name, value in flip0["weights"].items():
            assert torch.equal(value, same0["weights"][name]), (case, name)
            assert torch.equal(value, flip1["weights"][name]), (case, name)
            assert torch.equal(value, same1["weights"][name]), (case, name)
