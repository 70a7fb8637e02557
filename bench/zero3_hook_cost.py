"""What stage 3's module hooks cost per step on the CPU: the training thread's CPU time of a
tiny stage-3 step (forward, backward, step) over a model of many small modules, where the
hooks, not the arithmetic, are most of the work (docs/from-deepspeed.md, "usage records").

Run it once per source tree to compare two versions of the hooks, alternating the runs so
load on a shared machine hits both alike:

    PYTHONPATH=src python bench/zero3_hook_cost.py --world 1 --blocks 16 --steps 60

Prints the fastest and the median per-step thread CPU time (milliseconds) over the steps
after ``--warmup``, how many module forwards one step runs, and the fastest of repeated
calls of one module with a unit (a linear: its hooks gather and release it) and one without
(an activation), in microseconds a call: the minimum is what load on the machine disturbs
least.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from distributed import run_world  # noqa: E402


def _measure(rank, world, blocks, steps, warmup):
    import torch
    from torch import nn

    import zerotrain

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.norm, self.act = nn.LayerNorm(8), nn.GELU()

        def forward(self, x):
            return x + self.b(self.act(self.a(self.norm(x))))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(blocks)])
    calls = [0]
    for m in model.modules():
        m.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 0}}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    x = torch.randn(4, 8)
    times = []
    for step in range(steps):
        calls[0] = 0
        start = time.thread_time()
        engine.backward(engine(x).square().mean())
        engine.step()
        times.append(time.thread_time() - start)
    kept, forwards = sorted(times[warmup:]), calls[0]
    block = model[0]
    per_call = {}
    for name, module in [("with a unit", block.a), ("without", block.act)]:
        module(x)
        per_call[name] = min(timeit.repeat(lambda: module(x), number=200, repeat=15,
                                           timer=time.thread_time)) / 200 * 1e6
    return {"median_ms": 1e3 * statistics.median(kept), "min_ms": 1e3 * kept[0],
            "module_forwards": forwards, "per_call_us": per_call}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    opts = parser.parse_args()
    results = run_world(_measure, opts.world, opts.blocks, opts.steps, opts.warmup)
    r = results[0]
    calls = ", ".join(f"{k} {v:.1f} us" for k, v in r["per_call_us"].items())
    print(f"world {opts.world}, {opts.blocks} blocks, {r['module_forwards']} module forwards "
          f"a step: thread CPU a step min {r['min_ms']:.2f} ms, median "
          f"{r['median_ms']:.2f} ms; one module call (hooks included): {calls}")


if __name__ == "__main__":
    main()
