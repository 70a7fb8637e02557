#!/usr/bin/env python
"""Eager against ``engine.compile()`` at every ZeRO stage, on 2 CPU ranks (gloo).

For each stage (``--stages``), both ranks train the same small GPT (``gpt_model.py``: tied
head, learned positions, pre-LN blocks) from the same seed on the same tokens with AdamW,
first eagerly, then compiled with ``--backend`` (default inductor, whose CPU backend
generates C++), in the same two processes, one torch thread each. Compiled code is
cached per process, so stages 1 and 2 reuse the graph stage 0 compiled (the same module
code); stage 3 compiles its blocks.

Printed, one row per stage (a markdown table):

  eager / compiled s/step: median over steps 3..N of the step time (forward + backward +
      optimizer step, the max over ranks);
  ratio: compiled / eager median (below 1: compile is faster);
  CPU s/step: the same medians in process CPU time (less sensitive to other processes);
  first 2 steps: seconds of the compiled run's first two steps (compilation included);
  graphs: graphs dynamo compiled for this row, and how many of them after step 2
      (recompilations: should be 0);
  graph breaks: during the compiled row;
  max |Δloss|: between the compiled and eager losses, over all steps (rank-local);
  max |Δparam|: between the compiled and eager parameters after the last step (AdamW moves
      an element whose gradient is near zero by up to lr per step whatever its size, so a
      rounding difference there shows at the scale of lr; ``--optimizer SGD`` shows the
      rounding alone);
  other load: cores kept busy by other processes during the row (time rows with other
      load above ~0.3 are slowed by co-tenants).

    python bench/compile_cpu.py                           # 4 stages, inductor, ~5-10 min
    python bench/compile_cpu.py --stages 0,3 --steps 6 --backend aot_eager   # quick
"""
from __future__ import annotations

import argparse
import json
import os
import resource
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


def _busy_seconds() -> float | None:
    """Busy CPU seconds of the whole machine since boot (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler)."""
    me, ch = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + ch.ru_utime + ch.ru_stime


def _config(args, stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": args.batch, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                                      "weight_decay": 0.1}}
            if args.optimizer == "AdamW" else {"type": "SGD", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000,
                                  "allgather_bucket_size": 5_000_000,
                                  "stage3_param_persistence_threshold": 0}}


def _run(rank: int, args, stage: int, compiled: bool) -> dict:
    import zerotrain
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = GPT(args.d_model, args.layers, args.heads, args.seq, vocab=args.vocab)
    engine, *_ = zerotrain.initialize(model=model, config=_config(args, stage))
    if compiled:
        engine.compile(backend=args.backend, mode=args.mode)
    graphs0, breaks0 = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    busy0, cpu0, wall0 = _busy_seconds(), _own_cpu(), time.time()
    walls, cpus, losses, graphs_after_two = [], [], [], None
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        start, cpu = time.perf_counter(), time.process_time()
        loss = engine(idx, torch.roll(idx, -1, dims=1))
        engine.backward(loss)
        engine.step()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        losses.append(loss.item())
        if step == 1:
            graphs_after_two = counters["stats"]["unique_graphs"]
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"walls": walls, "cpus": cpus, "params": params, "losses": losses,
            "graphs": counters["stats"]["unique_graphs"] - graphs0,
            "recompiles": counters["stats"]["unique_graphs"] - graphs_after_two,
            "breaks": sum(counters["graph_break"].values()) - breaks0,
            "busy": (_busy_seconds() or 0) - (busy0 or 0), "own_cpu": _own_cpu() - cpu0,
            "wall": time.time() - wall0, "modules": engine.compiled_modules}


def _rank(rank: int, args, store_path: str, out_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank,
                            world_size=WORLD)
    rows = []
    for stage in args.stages:
        eager = _run(rank, args, stage, compiled=False)
        compiled = _run(rank, args, stage, compiled=True)
        diff = max((eager["params"][k].float() - compiled["params"][k].float()).abs().max()
                   .item() for k in eager["params"])
        mine = {"stage": stage, "diff": diff, "loss_diff": max(
            abs(a - b) for a, b in zip(eager["losses"], compiled["losses"]))}
        for name, res in (("eager", eager), ("compiled", compiled)):
            res.pop("params")
            mine[name] = res
        both = [None] * WORLD
        dist.all_gather_object(both, mine)
        rows.append(both)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _summary(both: list[dict], args) -> dict:
    def median(kind, key):
        per_step = [max(r[kind][key][i] for r in both) for i in range(args.steps)]
        return statistics.median(per_step[2:] or per_step)

    c = both[0]["compiled"]
    wall = max(r[k]["wall"] for r in both for k in ("eager", "compiled"))
    busy = sum(both[0][k]["busy"] for k in ("eager", "compiled"))
    own = sum(r[k]["own_cpu"] for r in both for k in ("eager", "compiled"))
    total_wall = sum(both[0][k]["wall"] for k in ("eager", "compiled"))
    return {
        "stage": both[0]["stage"], "eager": median("eager", "walls"),
        "compiled": median("compiled", "walls"),
        "eager_cpu": median("eager", "cpus"), "compiled_cpu": median("compiled", "cpus"),
        "first_two": max(sum(r["compiled"]["walls"][:2]) for r in both),
        "graphs": c["graphs"], "recompiles": max(r["compiled"]["recompiles"] for r in both),
        "breaks": max(r["compiled"]["breaks"] for r in both),
        "diff": max(r["diff"] for r in both), "modules": c["modules"],
        "loss_diff": max(r["loss_diff"] for r in both),
        "other_load": round(max(0.0, (busy - own) / total_wall), 2) if wall else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="0,1,2,3",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    parser.add_argument("--optimizer", choices=("AdamW", "SGD"), default="AdamW",
                        help="SGD (lr 1e-2) shows the rounding without Adam's amplification")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank, args=(args, os.path.join(tmp, "store"), out_path),
                           nprocs=WORLD, start_method="spawn")
        with open(out_path) as f:
            rows = [_summary(both, args) for both in json.load(f)]
    n_params = sum(p.numel() for p in GPT(args.d_model, args.layers, args.heads, args.seq,
                                         vocab=args.vocab).parameters())
    print(f"\ncpu count {os.cpu_count()}, torch {torch.__version__}, backend {args.backend} "
          f"(mode {args.mode}), world size {WORLD}, 1 thread per rank; GPT {args.layers} "
          f"layers, d_model {args.d_model}, vocab {args.vocab}, seq {args.seq}, "
          f"micro-batch {args.batch}, {n_params:,} parameters, {args.steps} steps of "
          f"{args.optimizer}\n")
    print("| stage | compiled modules | eager s/step | compiled s/step | ratio | CPU s/step "
          "eager / compiled | first 2 steps (s) | graphs (after step 2) | graph breaks | "
          "max \\|Δloss\\| | max \\|Δparam\\| | other load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {', '.join(r['modules'])} | {r['eager']:.4f} | "
              f"{r['compiled']:.4f} | {r['compiled'] / r['eager']:.2f} | "
              f"{r['eager_cpu']:.4f} / {r['compiled_cpu']:.4f} | {r['first_two']:.1f} | "
              f"{r['graphs']} ({r['recompiles']}) | {r['breaks']} | {r['loss_diff']:.1e} | "
              f"{r['diff']:.1e} | "
              f"{r['other_load']} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
