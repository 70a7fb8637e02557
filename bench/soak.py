"""Soak: train a small model at stage 3 for many steps and report memory drift.

    python bench/soak.py --steps 1000 --world-size 2

Prints, per rank, live tensor bytes (distinct storages), current RSS and the number of
Python objects after step 100 and after the last step, and their relative change. A leak
(growing caches of gathered parameters, hooks or autograd graphs) shows as growth here.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, store_path: str, steps: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    import zerotrain
    from zerotrain.core.memory import current_rss_bytes, live_tensor_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 1000, "overlap_comm": True}}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    probes = {}
    for step in range(1, steps + 1):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        if step in (100, steps):
            gc.collect()
            probes[step] = {"live_bytes": live_tensor_bytes(), "rss": current_rss_bytes(),
                            "objects": len(gc.get_objects())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(probes, f)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args.world_size, os.path.join(tmp, "store"), args.steps,
                                        tmp), nprocs=args.world_size, start_method="spawn")
        worst = 0.0
        for rank in range(args.world_size):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                probes = json.load(f)
            early, late = probes["100"], probes[str(args.steps)]
            for key in early:
                change = (late[key] - early[key]) / early[key]
                worst = max(worst, abs(change))
                print(f"rank {rank} {key:10s} step 100: {early[key]:>12,}  step {args.steps}: "
                      f"{late[key]:>12,}  change {change:+.3%}")
    print(f"largest change: {worst:.3%} ({'flat' if worst < 0.01 else 'GROWING'})")
    return 0 if worst < 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
