"""Shared by the multi-node tests: a simulated node layout and a short bf16 stage-3 run.

A 2 x 2 world is 4 gloo ranks whose environment says "2 ranks per node" (torchrun's
``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``), so the engine builds its node groups exactly as
on two machines; ``test_multinode.py`` also launches two real torchrun agents.
"""
from __future__ import annotations

import contextlib
import os

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


def stage3_config(precision: str = "bf16", **zero) -> dict:
    """Stage 3 with every parameter partitioned and 16-bit gradients on the wire."""
    config = R.engine_config(stage=3, precision=precision)
    config["zero_optimization"].update(stage3_max_reuse_distance=0, **zero)
    if precision != "fp32":
        config["data_types"] = {"grad_accum_dtype": precision}
    return config


def run_bytes(rank: int, world: int, ranks_per_node: int, zero: dict,
              steps: int = STEPS) -> dict:
    """Train ``steps`` steps; the communication breakdown, the padded Ψ and the weights."""
    import zerotrain
    with as_nodes(rank, ranks_per_node):
        model = R.make_model()
        engine, *_ = zerotrain.initialize(model=model, config=stage3_config(**zero))
        engine.communication_breakdown()   # start the window after initialize
        losses = R.train_engine(engine, steps=steps, rank=rank, ga=1)
        comm = engine.communication_breakdown()
        padded = sum(r.layout.padded_numel for r in engine.stage.shard_records())
        masters = {n: m.detach().clone() for r in engine.stage.shard_records()
                   for n, m in zip(r.names, _split(r))}
        memory = engine.memory_breakdown()
        engine.close()
    return {"comm": comm, "padded": padded, "losses": losses, "masters": masters,
            "memory": memory}


def _split(record):
    return [record.master[record.layout.shard_slice(slot)] for slot in record.layout.slots]
