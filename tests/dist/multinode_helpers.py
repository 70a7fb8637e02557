"""Shared by the multi-node tests: a simulated node layout and a short bf16 stage-3 run.

A 2 x 2 world is 4 gloo ranks whose environment says "2 ranks per node" (torchrun's
``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``), so the engine builds its node groups exactly as
on two machines; ``test_multinode.py`` also launches two real torchrun agents.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

import reference as R

STEPS = 2


@contextlib.contextmanager
def as_nodes(rank: int, ranks_per_node: int):
    """This rank believes it runs on node ``rank // ranks_per_node`` of equal nodes."""
    saved = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK")}
    os.environ.update(LOCAL_WORLD_SIZE=str(ranks_per_node),
                      GROUP_RANK=str(rank // ranks_per_node))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class WideNet(nn.Module):
    """Units of 16K elements (one per block), so int8/int4 blocks of 256 fill up."""

    def __init__(self, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(R.IN, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, R.OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return nn.functional.mse_loss(self.out(h).float(), y.float())


def make_model(name: str):
    torch.manual_seed(0)
    return WideNet() if name == "wide" else R.make_model()


def stage3_config(precision: str = "bf16", **zero) -> dict:
    """Stage 3 with every parameter partitioned and 16-bit gradients on the wire."""
    config = R.engine_config(stage=3, precision=precision)
    config["zero_optimization"].update(stage3_max_reuse_distance=0, **zero)
    if precision != "fp32":
        config["data_types"] = {"grad_accum_dtype": precision}
    return config


def run_bytes(rank: int, world: int, ranks_per_node: int, zero: dict, *,
              steps: int = STEPS, precision: str = "bf16", model: str = "tiny",
              save: str = "") -> dict:
    """Train ``steps`` steps; the communication breakdown, the padded Ψ (over the shard
    group), the full parameters after training, the memory breakdown."""
    import zerotrain
    with as_nodes(rank, ranks_per_node):
        module = make_model(model)
        engine, *_ = zerotrain.initialize(model=module,
                                          config=stage3_config(precision, **zero))
        engine.communication_breakdown()   # start the window after initialize
        losses = R.train_engine(engine, steps=steps, rank=rank, ga=1)
        comm = engine.communication_breakdown()
        padded = sum(r.layout.padded_numel for r in engine.stage.shard_records())
        memory = engine.memory_breakdown()
        if save:
            engine.save_checkpoint(save, tag="t")
        full = full_parameters(module)
        if precision == "fp32":   # DeepSpeed's accessor reads the masters: the same values
            from zerotrain.utils import safe_get_full_fp32_param
            masters = {n: safe_get_full_fp32_param(p) for n, p in module.named_parameters()}
            assert all(bool((masters[n] == full[n]).all()) for n in full), "masters differ"
        engine.close()
    return {"comm": comm, "padded": padded, "losses": losses, "full": full,
            "memory": memory, "numels": [p.ds_numel for p in module.parameters()]}


def full_parameters(module) -> dict:
    """Every parameter's full value (collective at stage 3)."""
    import zerotrain
    params = list(module.parameters())
    with zerotrain.zero.GatheredParameters(params):
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}
