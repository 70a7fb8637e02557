"""Chaos run: a training job under ``zerotrain launch --auto-resume`` with torchrun's
restarts, into which random faults are injected; every step's parameters (redone steps
included) and the final ones must equal an uninterrupted run bit for bit, and no resume may
lose a step beyond the last checkpoint published (and not since damaged) before its fault.

Faults that end a process (torchrun restarts the job, which auto-resumes):
- ``kill``: SIGKILL of a rank at a random step;
- ``stop``: SIGSTOP of a rank (its peer times out in its next collective, after
  ``comms_timeout``; torchrun then kills both);
- ``crash_save``: a rank SIGKILLs itself inside a save (after its rank file is written, or
  rank 0 after the tag is renamed into place and before ``latest`` is rewritten).
Faults the product must survive in the running process (no restart):
- ``disk_full``: one rank's checkpoint writes go to /dev/full (ENOSPC) during a save; the
  save must fail on every rank, ``latest`` must still name the previous tag, and training
  goes on from unchanged state;
- ``save_error``: an I/O error raised inside a save on one rank, at the same points as
  ``crash_save``; the same checks;
- ``truncate`` / ``corrupt``: rank 0 truncates a shard of the tag just published, or
  overwrites its ``manifest.json`` with garbage; every rank then builds a new engine with
  ``zerotrain.initialize``, whose auto-resume must skip the damaged tag and load the
  previous one (the steps since are redone). Flipped bits inside tensor data are not among
  them: the format keeps no checksums of tensor bytes, so that damage is not detectable.

A fault fires after a random number of steps (1 to 2 saves' worth) since the previous
fault or (re)start; save faults at the first save after that. The plan of a job is a list
of faults taken in order; after a restart every rank counts the faults already logged.

Usage:
    python bench/chaos.py --faults 1000 --seed 0 --out /tmp/chaos --json-out r.json
    python bench/chaos.py --faults 6 --per-job 6 --steps 24                # a short one
``--json-out`` is rewritten after every job (``complete`` false until the end, and on
SIGTERM/SIGINT the job in flight is stopped and not counted), so a partial run reports
what it reached.
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

RESTART_KINDS = ("kill", "stop", "crash_save")
IN_PROCESS_KINDS = ("disk_full", "save_error", "truncate", "corrupt")
KINDS = RESTART_KINDS + IN_PROCESS_KINDS
SAVE_KINDS = ("crash_save", "disk_full", "save_error", "truncate", "corrupt")
DAMAGE_KINDS = ("truncate", "corrupt")
WEIGHTS = "kill:2,stop:1,crash_save:1,disk_full:24,save_error:24,truncate:24,corrupt:24"
STEPS, SAVE_EVERY = 160, 2
HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------- the worker
def _event(path: str, **fields) -> None:
    with open(path, "a", encoding="utf-8") as f:   # one short line per write: O_APPEND
        f.write(json.dumps(dict(fields, t=round(time.time(), 3))) + "\n")


def _faults_logged(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(json.loads(line)["event"] == "fault" for line in f if line.strip())


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(step: int, rank: int):
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _digest(engine) -> str:
    h = hashlib.blake2b(digest_size=16)
    for _, p in engine.module.named_parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


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


class _SaveFault:
    """An in-process save fault on this rank for the duration of one save: writes of
    checkpoint files go to /dev/full, or an OSError is raised at a crash point."""

    def __init__(self, fault: dict):
        self.fault = fault

    def __enter__(self):
        from zerotrain.checkpoint import fs, stfile
        if self.fault["kind"] == "disk_full":
            stfile.open = lambda path, mode="r", *a, **k: open(  # noqa: SIM115
                "/dev/full" if "w" in mode else path, mode, *a, **k)
        else:
            self._crash_point = fs.crash_point
            point = self.fault["point"]

            def crash_point(name: str) -> None:
                if name == point:
                    raise OSError(errno.EIO, f"injected I/O error at save point {name!r}")
            fs.crash_point = crash_point
        return self

    def __exit__(self, *exc):
        from zerotrain.checkpoint import fs, stfile
        if self.fault["kind"] == "disk_full":
            del stfile.open
        else:
            fs.crash_point = self._crash_point
        return False


def worker(args: argparse.Namespace) -> None:
    import torch

    import zerotrain
    from zerotrain.checkpoint import fs
    from zerotrain.errors import CheckpointError
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(args.plan, encoding="utf-8") as f:
        plan = json.load(f)
    cursor = _faults_logged(args.events)   # every process of the job has ended: settled
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9,
              "comms_timeout": args.comms_timeout}
    engine, *_ = zerotrain.initialize(model=_model(), config=config)   # auto-resumes
    if rank == 0:
        _event(args.events, event="resume", attempt=attempt, step=engine.global_steps)
    since = 0   # steps since the last fault or (re)start, the same on every rank
    while engine.global_steps < args.steps:
        fault = plan[cursor] if cursor < len(plan) else None
        due = fault is not None and since >= fault["gap"]
        mine = fault is not None and fault["rank"] == rank
        step = engine.global_steps
        if due and fault["kind"] in ("kill", "stop") and mine:
            _event(args.events, event="fault", attempt=attempt, step=step, **fault)
            os.kill(os.getpid(), signal.SIGKILL if fault["kind"] == "kill" else signal.SIGSTOP)
        x, y = _batch(step, rank)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        since += 1
        done = engine.global_steps
        if rank == 0:
            _event(args.events, event="step", step=done, digest=_digest(engine))
        if done % SAVE_EVERY:
            continue
        # a tag is damaged only while an older one exists (global_step2 is never damaged):
        # with none, auto-resume rightly refuses to start over
        at_save = due and fault["kind"] in SAVE_KINDS and (
            fault["kind"] not in DAMAGE_KINDS or done > SAVE_EVERY)
        kind = fault["kind"] if at_save else None
        if kind == "crash_save":
            if mine:
                _event(args.events, event="fault", attempt=attempt, step=done, **fault)
                os.environ[fs.CRASH_ENV] = fault["point"]
            engine.save_checkpoint(args.save_dir)   # never returns on every rank
            raise RuntimeError(f"rank {rank}: a save crashed at {fault['point']!r} returned")
        if kind in ("disk_full", "save_error"):
            before = fs.read_latest(args.save_dir) if rank == 0 else None
            if rank == 0:
                _event(args.events, event="fault", attempt=attempt, step=done, **fault)
            try:
                if mine:
                    with _SaveFault(fault):
                        engine.save_checkpoint(args.save_dir)
                else:
                    engine.save_checkpoint(args.save_dir)
            except CheckpointError:
                pass
            else:
                raise RuntimeError(f"rank {rank}: a save with fault {fault} succeeded")
            if rank == 0 and fs.read_latest(args.save_dir) != before:
                raise RuntimeError(f"a failed save (fault {fault}) moved 'latest' from "
                                   f"{before} to {fs.read_latest(args.save_dir)}")
            cursor, since = cursor + 1, 0
            continue
        engine.save_checkpoint(args.save_dir)
        if rank == 0:
            _event(args.events, event="published", attempt=attempt, step=done)
        if kind in DAMAGE_KINDS:
            torch.distributed.barrier()          # every rank saw the save return
            if rank == 0:
                _event(args.events, event="fault", attempt=attempt, step=done, **fault)
                _damage(args.save_dir, done, kind)
            torch.distributed.barrier()
            engine.close()                       # a new engine finds the damaged tag
            engine, *_ = zerotrain.initialize(model=_model(), config=config)
            if rank == 0:
                _event(args.events, event="reload", attempt=attempt,
                       step=engine.global_steps)
            cursor, since = cursor + 1, 0
    if rank == 0:
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        torch.save(state, args.final)
        _event(args.events, event="done", attempt=attempt, step=engine.global_steps)
    engine.close()


# --------------------------------------------------------------------------- the driver
def _weights(text: str) -> dict[str, float]:
    weights = {}
    for item in text.split(","):
        kind, _, weight = item.partition(":")
        if kind not in KINDS:
            raise SystemExit(f"unknown fault kind {kind!r}; known: {', '.join(KINDS)}")
        weights[kind] = float(weight or 1)
    return weights


def _plan(rng: random.Random, faults: int, weights: dict[str, float]) -> list[dict]:
    kinds, odds = list(weights), list(weights.values())
    plan = []
    for _ in range(faults):
        kind = rng.choices(kinds, odds)[0]
        fault = {"kind": kind, "gap": rng.randint(1, 2 * SAVE_EVERY), "rank": rng.randrange(2)}
        if kind in ("crash_save", "save_error"):
            fault["point"] = rng.choice(["file", "latest"])
        if kind in DAMAGE_KINDS or fault.get("point") == "latest":
            fault["rank"] = 0   # only rank 0 publishes and rewrites ``latest``
        plan.append(fault)
    return plan


class Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def _job(out: str, name: str, plan: list[dict], args: argparse.Namespace) -> dict:
    root = os.path.join(out, name)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    paths = {k: os.path.join(root, k) for k in ("plan.json", "events.jsonl", "final.pt", "log")}
    with open(paths["plan.json"], "w", encoding="utf-8") as f:
        json.dump(plan, f)
    save_dir = os.path.join(root, "ckpt")
    restarts = sum(f["kind"] in RESTART_KINDS for f in plan)
    command = [sys.executable, "-m", "zerotrain", "launch", "--auto-resume", save_dir,
               "--standalone", "--nproc_per_node", "2", "--max-restarts", str(restarts + 2),
               "--monitor-interval", "0.2", HERE, "worker", "--plan", paths["plan.json"],
               "--events", paths["events.jsonl"], "--final", paths["final.pt"],
               "--save-dir", save_dir, "--steps", str(args.steps),
               "--comms-timeout", str(args.comms_timeout)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHELASTIC_ERROR_FILE="")
    started = time.perf_counter()
    with open(paths["log"], "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=args.job_timeout)
        except BaseException:   # a timeout or an interruption: nothing is left running
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    seconds = time.perf_counter() - started
    if returncode != 0 or not os.path.exists(paths["final.pt"]):
        with open(paths["log"], encoding="utf-8", errors="replace") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"job {name} failed (rc {returncode}):\n{tail}")
    with open(paths["events.jsonl"], encoding="utf-8") as f:
        events = [json.loads(line) for line in f if line.strip()]
    return {"root": root, "final": paths["final.pt"], "events": events, "seconds": seconds}


def check(events: list[dict], reference: dict[int, str]) -> dict:
    """Faults by kind, restarts, steps redone, the steps whose parameters differ from the
    uninterrupted run's, and the resumes that lost a step beyond the last checkpoint
    published (and not since damaged) before their fault."""
    intact: set[int] = set()
    by_kind: dict[str, int] = {}
    restarts = reloads = redone = 0
    lost, differ, pending = [], [], None
    for e in events:
        if e["event"] == "step":
            if reference.get(e["step"]) != e["digest"]:
                differ.append(e["step"])
        elif e["event"] == "published":
            intact.add(e["step"])
        elif e["event"] == "fault":
            by_kind[e["kind"]] = by_kind.get(e["kind"], 0) + 1
            if e["kind"] in DAMAGE_KINDS:
                intact.discard(e["step"])
            if e["kind"] in RESTART_KINDS + DAMAGE_KINDS:
                pending = (e["step"], max(intact, default=0))
        elif e["event"] == "reload" or (e["event"] == "resume" and e["attempt"] > 0):
            restarts += e["event"] == "resume"
            reloads += e["event"] == "reload"
            if pending is not None:
                reached, floor = pending
                if e["step"] < floor:
                    lost.append((e.get("attempt"), e["step"], floor))
                redone += max(0, reached - e["step"])
                pending = None
    planned = sum(n for k, n in by_kind.items() if k in RESTART_KINDS)
    return {"faults": sum(by_kind.values()), "by_kind": by_kind, "restarts": restarts,
            "unplanned_restarts": max(0, restarts - planned), "reloads": reloads,
            "steps_redone": redone, "lost": lost, "steps_differ": differ,
            "steps_checked": sum(e["event"] == "step" for e in events)}


def _write(path: str | None, total: dict) -> None:
    if path:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(total, f, indent=1)
        os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=12)
    parser.add_argument("--per-job", type=int, default=40, help="faults planned per job")
    parser.add_argument("--weights", default=WEIGHTS,
                        help="kind:weight,... (kinds left out are not injected)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--comms-timeout", type=float, default=10.0)
    parser.add_argument("--job-timeout", type=float, default=1800.0)
    parser.add_argument("--deadline", type=float, default=None,
                        help="start no job after this many seconds")
    parser.add_argument("--out", default="/tmp/zerotrain-chaos")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    import torch
    signal.signal(signal.SIGTERM, _interrupt)
    rng = random.Random(args.seed)
    weights = _weights(args.weights)
    started = time.perf_counter()
    total = {"command": " ".join(sys.argv), "target_faults": args.faults, "complete": False,
             "faults": 0, "by_kind": {k: 0 for k in weights}, "restarts": 0,
             "unplanned_restarts": 0, "reloads": 0, "steps_redone": 0, "steps_checked": 0,
             "lost": [], "jobs": 0, "jobs_bitwise_equal": 0, "mismatched_jobs": 0,
             "failed_jobs": [], "wall_s": 0.0}
    try:
        reference = _job(args.out, "reference", [], args)
        expected = torch.load(reference["final"], weights_only=True)
        digests = {e["step"]: e["digest"] for e in reference["events"] if e["event"] == "step"}
        while total["faults"] < args.faults:
            if args.deadline and time.perf_counter() - started > args.deadline:
                total["stopped_by"] = "deadline"
                break
            plan = _plan(rng, min(args.per_job, args.faults - total["faults"]), weights)
            name = f"job{total['jobs']}"
            try:
                job = _job(args.out, name, plan, args)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:   # reported, not hidden
                total["jobs"] += 1
                total["failed_jobs"].append({"job": name, "plan": plan,
                                             "error": str(exc)[-2000:]})
                print(f"{name} FAILED: {str(exc)[-2000:]}", flush=True)
                continue
            got = torch.load(job["final"], weights_only=True)
            same = sorted(got) == sorted(expected) and all(
                torch.equal(got[k], expected[k]) for k in expected)
            summary = check(job["events"], digests)
            same = same and not summary["steps_differ"]
            total["jobs"] += 1
            total["jobs_bitwise_equal"] += int(same)
            total["mismatched_jobs"] += int(not same)
            for key in ("faults", "restarts", "unplanned_restarts", "reloads",
                        "steps_redone", "steps_checked"):
                total[key] += summary[key]
            total["lost"] += summary["lost"]
            for kind, n in summary["by_kind"].items():
                total["by_kind"][kind] = total["by_kind"].get(kind, 0) + n
            total["wall_s"] = round(time.perf_counter() - started, 1)
            _write(args.json_out, total)
            print(f"{name}: {summary['faults']} faults {summary['by_kind']}, "
                  f"{summary['restarts']} restarts, {summary['reloads']} reloads, "
                  f"{summary['steps_redone']} steps redone, bitwise equal: {same} "
                  f"({summary['steps_checked']} steps checked), {job['seconds']:.1f} s; "
                  f"total {total['faults']} faults, {total['wall_s']} s", flush=True)
            if same:   # the events stay (a few hundred KB), the checkpoints go
                shutil.rmtree(os.path.join(job["root"], "ckpt"), ignore_errors=True)
        else:
            total["complete"] = True
    except (Interrupted, KeyboardInterrupt) as exc:
        total["stopped_by"] = f"signal {exc or 'SIGINT'} (the job in flight is not counted)"
    total["wall_s"] = round(time.perf_counter() - started, 1)
    total["ok"] = total["mismatched_jobs"] == 0 and not total["lost"] and \
        not total["failed_jobs"] and total["jobs"] > 0
    _write(args.json_out, total)
    print(json.dumps(total))
    return 0 if total["ok"] else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        p = argparse.ArgumentParser()
        for name in ("--plan", "--events", "--final", "--save-dir"):
            p.add_argument(name, required=True)
        p.add_argument("--steps", type=int, default=STEPS)
        p.add_argument("--comms-timeout", type=float, default=10.0)
        worker(p.parse_args(sys.argv[2:]))
    else:
        sys.exit(main())
