"""Chaos run: a training job under ``zerotrain launch --auto-resume`` with torchrun's
restarts, into which random faults are injected; the final parameters must equal an
uninterrupted run bit for bit, and no resume may lose a step beyond the last checkpoint
published before its fault.

Faults (one per torchrun attempt, drawn from ``--seed``; the faulting rank injects it
itself at a random step):
- ``kill``: SIGKILL of a rank;
- ``stop``: SIGSTOP of a rank (its peer times out in its next collective, after
  ``comms_timeout``; torchrun then kills both);
- ``disk_full``: one rank's checkpoint writes go to /dev/full (ENOSPC) during a save;
- ``crash_save``: a rank SIGKILLs itself inside a save (after its first file is written,
  or rank 0 after the tag is renamed into place and before ``latest`` is rewritten);
- ``truncate`` / ``corrupt``: rank 0 truncates a shard of the newest published tag, or
  overwrites its ``manifest.json`` with garbage, then SIGKILLs itself (the damage a next
  start finds). Flipped bits inside tensor data are not among them: the format keeps no
  checksums of tensor bytes, so that damage is not detectable.

Usage:
    python bench/chaos.py --faults 1000 --seed 0 --out /tmp/chaos        # the full run
    python bench/chaos.py --faults 3 --kinds kill,disk_full,truncate     # a short one
The summary (faults, restarts, steps redone, wall time) is printed and written as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

KINDS = ("kill", "stop", "disk_full", "crash_save", "truncate", "corrupt")
STEPS, SAVE_EVERY = 24, 3
HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------- the worker
def _event(path: str, **fields) -> None:
    with open(path, "a", encoding="utf-8") as f:   # one short line per write: O_APPEND
        f.write(json.dumps(fields) + "\n")


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(step: int, rank: int):
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _damage(save_dir: str, step: int, kind: str) -> None:
    tag = os.path.join(save_dir, f"global_step{step}")
    if kind == "corrupt":
        with open(os.path.join(tag, "manifest.json"), "r+b") as f:
            f.write(b"\x00garbage\xff" * 8)
        return
    shards = sorted(n for n in os.listdir(tag) if n.endswith(".safetensors"))
    path = os.path.join(tag, shards[0])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def worker(args: argparse.Namespace) -> None:
    import torch

    import zerotrain
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(args.plan, encoding="utf-8") as f:
        plan = json.load(f)
    fault = plan[attempt] if attempt < len(plan) else None
    if fault is not None and fault["kind"] == "crash_save" and fault["point"] != "file":
        # only rank 0 renames and rewrites ``latest``; a fresh tag is never swapped
        fault = dict(fault, point="latest", rank=0)
    mine = fault is not None and fault["rank"] == rank
    if mine and fault["kind"] == "crash_save":
        os.environ["ZEROTRAIN_CHECKPOINT_CRASH_AT"] = fault["point"]
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9,
              "comms_timeout": args.comms_timeout}
    model = _model()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    start = engine.global_steps
    if rank == 0:
        _event(args.events, event="resume", attempt=attempt, step=start)
    if fault is not None:   # planned before the resume point: at the first chance after it
        at = max(fault["step"], start + 1)   # the resume point's own save is not redone
        fault = dict(fault, step=at if fault["kind"] in ("kill", "stop") else
                     -(-at // SAVE_EVERY) * SAVE_EVERY)
    for step in range(start, args.steps):
        if mine and step == fault["step"] and fault["kind"] in ("kill", "stop"):
            _event(args.events, event="fault", attempt=attempt, **fault)
            os.kill(os.getpid(), signal.SIGKILL if fault["kind"] == "kill" else signal.SIGSTOP)
        x, y = _batch(step, rank)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        done = step + 1
        if done % SAVE_EVERY:
            continue
        if mine and done == fault["step"] and fault["kind"] in ("disk_full", "crash_save"):
            _event(args.events, event="fault", attempt=attempt, **fault)
            if fault["kind"] == "disk_full":
                from zerotrain.checkpoint import stfile
                stfile.open = lambda path, mode="r", *a, **k: open(  # noqa: SIM115
                    "/dev/full" if "w" in mode else path, mode, *a, **k)
        engine.save_checkpoint(args.save_dir)   # a full disk raises here on every rank
        if rank == 0:
            _event(args.events, event="published", attempt=attempt, step=done)
        if mine and done == fault["step"] and fault["kind"] in ("truncate", "corrupt"):
            torch.distributed.barrier()          # both ranks saw the save return
            _event(args.events, event="fault", attempt=attempt, **fault)
            _damage(args.save_dir, done, fault["kind"])
            os.kill(os.getpid(), signal.SIGKILL)
        if fault is not None and fault["kind"] in ("truncate", "corrupt") and \
                done == fault["step"]:
            torch.distributed.barrier()          # the peer: wait for the damage and death
    if rank == 0:
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        torch.save(state, args.final)
        _event(args.events, event="done", attempt=attempt, step=engine.global_steps)
    engine.close()


# --------------------------------------------------------------------------- the driver
def _plan(rng: random.Random, faults: int, kinds: list[str], steps: int) -> list[dict]:
    plan = []
    for _ in range(faults):
        kind = rng.choice(kinds)
        fault = {"kind": kind, "rank": 0 if kind in ("truncate", "corrupt") else rng.randrange(2)}
        if kind in ("kill", "stop"):
            fault["step"] = rng.randrange(1, steps)
        else:   # at a save
            fault["step"] = rng.randrange(1, steps // SAVE_EVERY + 1) * SAVE_EVERY
        if kind == "crash_save":
            fault["point"] = rng.choice(["file", "latest"])
        plan.append(fault)
    return plan


def _job(out: str, name: str, plan: list[dict], args: argparse.Namespace) -> dict:
    root = os.path.join(out, name)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    paths = {k: os.path.join(root, k) for k in ("plan.json", "events.jsonl", "final.pt")}
    with open(paths["plan.json"], "w", encoding="utf-8") as f:
        json.dump(plan, f)
    save_dir = os.path.join(root, "ckpt")
    command = [sys.executable, "-m", "zerotrain", "launch", "--auto-resume", save_dir,
               "--standalone", "--nproc_per_node", "2", "--max-restarts", str(len(plan) + 2),
               "--monitor-interval", "0.2", HERE, "worker", "--plan", paths["plan.json"],
               "--events", paths["events.jsonl"], "--final", paths["final.pt"],
               "--save-dir", save_dir, "--steps", str(args.steps),
               "--comms-timeout", str(args.comms_timeout)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHELASTIC_ERROR_FILE="")
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True,
                            timeout=args.job_timeout)
    seconds = time.perf_counter() - started
    if result.returncode != 0 or not os.path.exists(paths["final.pt"]):
        raise RuntimeError(f"job {name} failed (rc {result.returncode}):\n"
                           f"{result.stderr[-4000:]}")
    with open(paths["events.jsonl"], encoding="utf-8") as f:
        events = [json.loads(line) for line in f if line.strip()]
    return {"root": root, "final": paths["final.pt"], "events": events, "seconds": seconds}


def check(events: list[dict]) -> dict:
    """Restarts, steps redone, and the resumes that lost a step beyond the last checkpoint
    published (and not since damaged) before their fault."""
    intact: set[int] = set()
    faults = restarts = redone = 0
    lost, pending = [], None
    for e in events:
        if e["event"] == "published":
            intact.add(e["step"])
        elif e["event"] == "fault":
            faults += 1
            if e["kind"] in ("truncate", "corrupt"):
                intact.discard(e["step"])
            pending = (e["step"], max(intact, default=0))
        elif e["event"] == "resume" and e["attempt"] > 0:
            restarts += 1
            if pending is not None:
                reached, floor = pending
                if e["step"] < floor:
                    lost.append((e["attempt"], e["step"], floor))
                redone += max(0, reached - e["step"])
                pending = None
    return {"faults": faults, "restarts": restarts, "steps_redone": redone, "lost": lost}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=12)
    parser.add_argument("--per-job", type=int, default=6, help="faults per torchrun job")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--comms-timeout", type=float, default=20.0)
    parser.add_argument("--job-timeout", type=float, default=1800.0)
    parser.add_argument("--deadline", type=float, default=None,
                        help="stop starting jobs after this many seconds")
    parser.add_argument("--out", default="/tmp/zerotrain-chaos")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    import torch
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    started = time.perf_counter()
    reference = _job(args.out, "reference", [], args)
    expected = torch.load(reference["final"], weights_only=True)
    total = {"faults": 0, "restarts": 0, "steps_redone": 0, "lost": [], "jobs": 0,
             "mismatched_jobs": 0, "by_kind": {k: 0 for k in kinds}}
    while total["faults"] < args.faults:
        if args.deadline and time.perf_counter() - started > args.deadline:
            break
        plan = _plan(rng, min(args.per_job, args.faults - total["faults"]), kinds, args.steps)
        try:
            job = _job(args.out, f"job{total['jobs']}", plan, args)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:   # reported, not hidden
            total["jobs"] += 1
            total.setdefault("failed_jobs", []).append({"plan": plan, "error": str(exc)[-2000:]})
            print(f"job {total['jobs']} FAILED: {str(exc)[-2000:]}", flush=True)
            continue
        got = torch.load(job["final"], weights_only=True)
        same = sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k])
                                                       for k in expected)
        summary = check(job["events"])
        total["jobs"] += 1
        total["mismatched_jobs"] += int(not same)
        for key in ("faults", "restarts", "steps_redone"):
            total[key] += summary[key]
        total["lost"] += summary["lost"]
        for event in job["events"]:
            if event["event"] == "fault":
                total["by_kind"][event["kind"]] += 1
        print(f"job {total['jobs']}: {summary['faults']} faults, {summary['restarts']} "
              f"restarts, {summary['steps_redone']} steps redone, bitwise equal: {same}, "
              f"{job['seconds']:.1f} s", flush=True)
        shutil.rmtree(job["root"], ignore_errors=True)
    total["wall_s"] = round(time.perf_counter() - started, 1)
    total["ok"] = total["mismatched_jobs"] == 0 and not total["lost"] and \
        not total.get("failed_jobs")
    print(json.dumps(total))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(total, f, indent=1)
    return 0 if total["ok"] else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        p = argparse.ArgumentParser()
        for name in ("--plan", "--events", "--final", "--save-dir"):
            p.add_argument(name, required=True)
        p.add_argument("--steps", type=int, default=STEPS)
        p.add_argument("--comms-timeout", type=float, default=20.0)
        worker(p.parse_args(sys.argv[2:]))
    else:
        sys.exit(main())
