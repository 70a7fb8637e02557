"""What the divergence checks cost on the CPU (gloo): step time with and without them, and
the bytes they add per gather and per step (docs/BENCHMARKS.md, "Divergence checks").

"Without" patches the checks out in the same processes: unit gathers go out as before the
check (one by one, no header) and the collective trail notes nothing. Modes alternate
step by step, so load on the machine hits both alike; the median step time is reported.

    PYTHONPATH=src python bench/divergence_overhead.py --world 2 --blocks 8 --width 256
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from distributed import run_world  # noqa: E402


def _unchecked(comm, check, unit_index, shard, outputs, inputs, *, label, host=None):
    if host is not None:
        _launch_held(host, unit_index)
    return [comm.all_gather_into_many(outputs, inputs, label=label)] if outputs else []


def _launch_held(self, unit_index, *, dtype=None, label=""):
    """HostLaunches.agree without its header: the held reductions go out as they are."""
    held, self._held = self._held, []
    for reduction in held:
        reduction.launch()


def _bench(rank, world, blocks, width, steps, stage):
    import torch
    from torch import nn

    import zerotrain
    from zerotrain.comm import trail as trail_mod
    from zerotrain.stages.zero3 import gather_check, wire
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                            for _ in range(blocks)])
    config = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": width * width,
                                    "overlap_comm": False}}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    x = torch.randn(16, width)
    checked, note = wire.start_checked, trail_mod.CollectiveTrail.note
    agree = gather_check.HostLaunches.agree
    times = {"checked": [], "unchecked": []}
    ledger = engine.comm.ledger
    for step in range(2 * steps + 4):
        mode = "checked" if step % 2 == 0 else "unchecked"
        wire.start_checked = checked if mode == "checked" else _unchecked
        trail_mod.CollectiveTrail.note = note if mode == "checked" else (lambda *a: None)
        gather_check.HostLaunches.agree = agree if mode == "checked" else _launch_held
        ledger.reset()
        start = time.perf_counter()
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - start
        if step >= 4:
            times[mode].append(elapsed)
        if mode == "checked":
            snap = ledger.snapshot()
    wire.start_checked, trail_mod.CollectiveTrail.note = checked, note
    gather_check.HostLaunches.agree = agree
    engine.close()
    return {m: statistics.median(t) for m, t in times.items()}, snap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    for stage in args.stages:
        (times, snap), *_ = run_world(_bench, args.world, args.blocks, args.width,
                                      args.steps, stage, timeout=3600)
        calls = snap["calls"]
        check = snap["bytes"].get("divergence_check", 0)
        gathers = calls.get("all_gather", 0)
        print(f"stage {stage}, {args.world} ranks, {args.blocks} blocks of {args.width}: "
              f"step {times['checked'] * 1e3:.2f} ms checked, "
              f"{times['unchecked'] * 1e3:.2f} ms unchecked "
              f"({100 * (times['checked'] / times['unchecked'] - 1):+.1f}%); "
              f"check bytes per step {check}, collective calls {calls}")
        if stage == 3 and gathers:
            print(f"  per unit gather: {HEADER_NOTE}")


HEADER_NOTE = ("16 bytes per rank (the header); on gloo one extra all_gather launch per unit "
               "gather, per optimizer step and per backward's held tail of reductions, "
               "counted in the calls above")

if __name__ == "__main__":
    main()
