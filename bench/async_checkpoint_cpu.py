#!/usr/bin/env python
"""How long a checkpoint save blocks training, synchronous against asynchronous, on 2 CPU
ranks (gloo), and how fast training runs while an asynchronous save is being written.

Both ranks train a GPT of ``gpt_model.py`` (default d_model 768, 10 blocks, tied head:
109.5M parameters) with AdamW at ZeRO stage ``--stage`` (default 2), one torch thread each.
After ``--warmup`` steps, each round does:

  sync:  ``save_checkpoint(dir, tag)``: the time it blocks (max over ranks);
  async: ``save_checkpoint(dir, tag, async_save=True)``: the time it blocks, then training
         steps until the background write has finished (``writer.in_flight`` false on every
         rank), then ``wait_for_checkpoint()``; the step times while the write was in flight;
  base:  as many steps with no save in flight (the throughput to compare against).

Printed (a markdown table, medians over ``--rounds``): synchronous blocked s, asynchronous
blocked s, their ratio, the background write's wall time, the step time with and without a
save in flight and the throughput ratio, and ``other load`` (cores other processes kept busy;
above ~0.3 the times are slowed by co-tenants).

    python bench/async_checkpoint_cpu.py                     # ~110M parameters, 3 rounds
    python bench/async_checkpoint_cpu.py --d-model 256 --layers 2 --rounds 1    # quick
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_model import GPT  # noqa: E402  (bench/ is not a package)

WORLD = 2


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _any(flag: bool) -> bool:
    return _max(1.0 if flag else 0.0) > 0


def _rank(rank: int, args, store: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank,
                            world_size=WORLD)
    import zerotrain
    torch.manual_seed(0)
    model = GPT(args.d_model, args.layers, args.heads, args.seq)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(rank)

    def step() -> float:
        idx = torch.randint(0, model.vocab, (1, args.seq), generator=gen)
        start = time.perf_counter()
        engine.backward(engine(idx, idx))
        engine.step()
        return _max(time.perf_counter() - start)

    for _ in range(args.warmup):
        step()
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for r in range(args.rounds):
        busy0, wall0, cpu0 = _busy_seconds(), time.perf_counter(), time.process_time()
        start = time.perf_counter()
        engine.save_checkpoint(args.dir, tag=f"sync{r}")
        sync_s = _max(time.perf_counter() - start)
        start = time.perf_counter()
        engine.save_checkpoint(args.dir, tag=f"async{r}", async_save=True)
        async_s = _max(time.perf_counter() - start)
        writer = engine._checkpoint_writer
        in_flight = []
        while _any(writer.in_flight):
            in_flight.append(step())
        write_s = _max(time.perf_counter() - start)
        engine.wait_for_checkpoint()
        base = [step() for _ in range(max(len(in_flight), 2))]
        wall = time.perf_counter() - wall0
        own = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
        dist.all_reduce(own)   # both ranks' CPU seconds, writer threads included
        other = max(0.0, (_busy_seconds() - busy0 - float(own)) / wall)
        rows.append({"sync_s": sync_s, "async_s": async_s, "write_s": write_s,
                     "steps_in_flight": len(in_flight),
                     "step_in_flight_s": statistics.median(in_flight) if in_flight else None,
                     "step_base_s": statistics.median(base), "other_load": other})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"params": params, "rows": rows,
                       "staging_bytes": writer.buffer.nbytes}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="save directory (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = args.dir or os.path.join(tmp, "ckpt")
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_rank, args=(args, os.path.join(tmp, "store"), out),
                           nprocs=WORLD, start_method="spawn")
        with open(out) as f:
            result = json.load(f)
        size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(args.dir)
                   for n in names if "sync0" in d and "async" not in d)
        shutil.rmtree(args.dir, ignore_errors=True)
    rows = result["rows"]

    def med(key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    print(f"params {result['params']:,} · stage {args.stage} · world {WORLD} · "
          f"checkpoint {size / 2**20:.0f} MiB · staging buffer per rank "
          f"{result['staging_bytes'] / 2**20:.0f} MiB · rounds {len(rows)}")
    print("| sync blocked s | async blocked s | async/sync | background write s | "
          "s/step in flight | s/step no save | throughput in flight | other load |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {med('sync_s'):.3f} | {med('async_s'):.3f} | "
          f"{med('async_s') / med('sync_s'):.1%} | {med('write_s'):.3f} | "
          f"{med('step_in_flight_s'):.3f} | {med('step_base_s'):.3f} | "
          f"{med('step_base_s') / med('step_in_flight_s'):.0%} | {med('other_load'):.2f} |")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
