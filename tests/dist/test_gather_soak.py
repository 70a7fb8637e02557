"""Stage 3 keeps the process heap intact over a long run with gathers in flight.

On the host, a unit's gathers run on gloo's worker threads while the training thread runs
the units before it; a coalesced gather there (torch 2.13) corrupted the heap within a few
dozen steps of this model at 3 ranks (``malloc(): unaligned tcache chunk``, ``double free
or corruption``), so host gathers go out one by one (Note "coalesced gathers" in
``comm/communicator.py``). This runs the same kind of model long enough for that to show:
six residual blocks of uneven widths, prefetch on, no reuse, every unit released between
forward and backward. With host gathers coalesced it failed 2 of the 3 tries (a rank
killed by SIGABRT); the pool reports a rank that dies by its signal.
"""
import torch
import torch.nn.functional as F
from torch import nn

import reference as R

STEPS = 100


class Blocks(nn.Module):
    def __init__(self, width: int = 384, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(R.IN, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width + 7), nn.GELU(),
                          nn.Linear(width + 7, width)) for _ in range(depth))
        self.out = nn.Linear(width, R.OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return F.mse_loss(self.out(h), y)


def _soak(rank, world):
    import zerotrain
    torch.manual_seed(0)
    config = R.engine_config(stage=3, ga=2, clip=0.5)
    config["zero_optimization"].update(stage3_max_reuse_distance=0, overlap_comm=True,
                                       stage3_param_persistence_threshold=0,
                                       stage3_prefetch_bucket_size=10**6)
    engine, *_ = zerotrain.initialize(model=Blocks(), config=config)
    losses = []
    for step in range(STEPS):
        for micro in range(2):
            loss = engine(*R.micro_batch(step, rank, micro, size=16))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


def test_stage3_gathers_in_flight_leave_the_heap_intact(worlds):
    for losses in worlds.run(3, _soak):
        assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), losses
