"""Predicted against measured peak of one training step, per rank, on 2 gloo ranks (CPU).

Both sides count live tensor storages after every operation (``PeakTracker``), from the
model as built to the end of the optimizer step, on rank 0: the prediction runs the engine
on fake tensors as rank 0 of a fake world (``zerotrain.planner.plan_peak``), the measurement
runs the same ``run_step`` on real tensors. Prints a Markdown table and the worst case.

    PYTHONPATH=src python bench/planner_check.py [--families gpt2-tiny,llama-tiny,...]
    PLANNER_DTYPE=bf16 ... --families mixtral-tiny   (torch's fake grouped_mm is bf16 only)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
FAMILIES = ("gpt2-tiny", "llama-tiny", "mistral-tiny", "bert-tiny")
WORLD = 2


DTYPE = os.environ.get("PLANNER_DTYPE", "fp32")


def _spec(family, stage, ac):
    from zerotrain.planner import StepSpec
    return StepSpec(os.path.join(HERE, f"{family}.json"), micro_batch=2, seq_len=32,
                    gpus=WORLD, stage=stage, dtype=DTYPE, activation_checkpointing=ac,
                    backend="gloo")


def _rank(rank, store, cases, out):
    from zerotrain.estimate.peak import PeakTracker
    from zerotrain.planner import build_model, counting_gloo_copies, run_step

    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank,
                            world_size=WORLD)
    results = []
    for case in cases:
        spec = _spec(*case)
        torch.manual_seed(0)
        tracker = PeakTracker()
        with counting_gloo_copies(tracker):
            engine, _ = run_step(spec, build_model(spec), tracker)
        results.append((tracker.peak, tracker.where))
        engine.destroy()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args(argv)
    from zerotrain.planner import plan_peak

    cases = [(f, s, ac) for f in args.families.split(",") for s in range(4)
             for ac in (False, True)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "measured.pt")
        mp.start_processes(_rank, args=(os.path.join(tmp, "store"), cases, out),
                           nprocs=WORLD, start_method="spawn")
        measured = torch.load(out)
    print("| model | stage | AC | predicted (B) | measured (B) | error | peak at |")
    print("|---|---|---|---|---|---|---|")
    worst = None
    for case, (real, where) in zip(cases, measured):
        p = plan_peak(_spec(*case))
        err = p.peak_bytes / real - 1
        print(f"| {case[0]} | {case[1]} | {'on' if case[2] else 'off'} | {p.peak_bytes} | "
              f"{real} | {100 * err:+.2f}% | {p.where} / {where} |", flush=True)
        if worst is None or abs(err) > abs(worst[0]):
            worst = (err, case)
    print(f"\nworst case: {worst[1]} at {100 * worst[0]:+.2f}%")
    return 0 if abs(worst[0]) <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
