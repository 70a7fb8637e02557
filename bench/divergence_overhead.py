"""What the divergence checks cost on the CPU (gloo): step time with and without them, and
the bytes they add per gather and per step (docs/BENCHMARKS.md, "Divergence checks").

Four modes take turns step by step in the same processes, so load on the shared machine
hits them alike: "checked" (as shipped), "unchecked" (the checks patched out: no header, no
launch plan, reductions unheld, the collective trail notes nothing, no votes), "headers" (the
checks without launch plans: a header before every stage-3 launch, as before plans) and
"unvoted" (as shipped but for the votes before a reducing backward and an update at stages
0-2, Note "backwards that reduce" in engine/accumulation.py: checked / unvoted is their cost),
"synchronous" (as shipped but each vote read at once, as votes were before their verdicts
were deferred, Note "deferred verdicts" in comm/agreement.py: synchronous / unvoted). Each
width gets its own engine. Stages 0-2 (``--stages`` without 3) run ``_bench_votes`` instead:
the votes there stop once a vote plan stands (engine/vote_plan.py), which steps of other
modes in between would break, so the unvoted and unchecked steps run on an engine of their
own. Reported: median step times, and the median over the run of
each checked (headers) step's time over the unchecked step's right after it, in wall time
and in the training thread's CPU time (which load on the machine disturbs less: what the
checks add once no header waits is CPU work in that thread), and the CPU time spent inside
the checks' own functions per checked step (the cost of timing each call taken off). The first
``--warmup`` steps of each mode are left out (stage 3 sends headers until the ranks agree
on a plan, zero3/plan.py); the extra launches and check bytes are counted in one step of
each mode after it.

    PYTHONPATH=src python bench/divergence_overhead.py --world 2 --widths 256 512 1024
    PYTHONPATH=src python bench/divergence_overhead.py --stages 0 1 2 --widths 64 256 --ga 1 4
    PYTHONPATH=src python bench/divergence_overhead.py --round-trip   # one vote alone
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



def _timed_step(engine, x, ga: int) -> tuple[float, float]:
    """Wall and thread CPU seconds of one step: ``ga`` micro-steps."""
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(ga):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    return time.perf_counter() - start, time.thread_time() - cpu

def _patches():
    """(module, name, checked, unchecked) for every check, so a mode is a set of assignments;
    the votes' patch comes last (mode "unvoted" applies only that one)."""
    from zerotrain.comm import trail as trail_mod
    from zerotrain.engine import accumulation
    from zerotrain.stages.zero3 import gather_check

    def before_gather(self, unit_index, *, dtype, label):
        self._launch_held()

    def before_step(self, *, label):
        self._launch_held()

    def reduce_scatter(self, output, input, *, async_op=False, label=""):
        return self.comm.reduce_scatter(output, input, async_op=async_op, label=label)

    def launch_held(self):
        held, self._held = self._held, []
        for reduction in held:
            reduction.launch()

    H = gather_check.HostLaunches
    H._launch_held = launch_held
    return [(trail_mod.CollectiveTrail, "note", trail_mod.CollectiveTrail.note,
             lambda *a: None),
            (H, "before_gather", H.before_gather, before_gather),
            (H, "before_step", H.before_step, before_step),
            (H, "reduce_scatter", H.reduce_scatter, reduce_scatter),
            (accumulation, "vote", accumulation.vote, lambda *a, **k: None)]


MODES = ("checked", "unchecked", "headers", "unvoted", "synchronous")   # a step each, in turn


class _Stopwatch:
    """CPU time spent in the checks' own functions (no collective inside them)."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self.own = self._calibrate()   # what timing one call costs, taken off each call

    def wrap(self, owner, name):
        setattr(owner, name, self._timed(getattr(owner, name)))

    def spent(self) -> float:
        return max(0.0, self.seconds - self.calls * self.own)

    def _timed(self, inner):
        def timed(*args, **kwargs):   # CPU time of this thread: preemption not counted
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start
                self.calls += 1
        return timed

    def _calibrate(self, n: int = 20000) -> float:
        empty = self._timed(lambda: None)
        empty()
        self.seconds = 0.0
        start = time.thread_time()
        for _ in range(n):
            empty()
        total = time.thread_time() - start
        inside, self.seconds, self.calls = self.seconds, 0.0, 0
        return min(inside, total) / n


def _bench(rank, world, blocks, widths, steps, warmup, stage, ga=1):
    import torch
    from torch import nn

    import zerotrain
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from zerotrain.comm import trail as trail_mod
    from zerotrain.stages.zero3 import plan as plan_mod
    stopwatch = _Stopwatch()   # before the patches: "unchecked" leaves these uncalled
    for owner, name in ((trail_mod.CollectiveTrail, "note"), (trail_mod.CollectiveTrail,
                        "carried"), (plan_mod.LaunchPlan, "admit"),
                        (plan_mod.LaunchPlan, "end_cycle")):
        stopwatch.wrap(owner, name)
    patches = _patches()
    from zerotrain.comm import Communicator
    defer = Communicator.defer
    results = {}
    for width in widths:
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                for _ in range(blocks)])
        config = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10 ** 6,
                  "gradient_accumulation_steps": ga,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage,
                                        "stage3_param_persistence_threshold": 0,
                                        "stage3_prefetch_bucket_size": width * width,
                                        "overlap_comm": False}}
        engine, *_ = zerotrain.initialize(model=model, config=config)
        x = torch.randn(16, width)
        ledger = engine.comm.ledger
        times = {mode: [] for mode in MODES}
        cpus = {mode: [] for mode in MODES}   # the training thread's CPU time per step
        inside = {mode: [] for mode in MODES}   # time in the checks' own code per step
        snaps = {}
        host = getattr(getattr(engine.stage, "wire", None), "host", None)
        plan = getattr(host, "plan", None)
        for step in range(len(MODES) * (steps + warmup)):
            mode = MODES[step % len(MODES)]
            for k, (owner, name, checked, unchecked) in enumerate(patches):
                off = mode == "unchecked" or (mode == "unvoted" and k == len(patches) - 1)
                setattr(owner, name, unchecked if off else checked)
            Communicator.defer = ((lambda self, read: read()) if mode == "synchronous"
                                  else defer)
            if host is not None:   # "headers": the checks without launch plans
                host.plan = None if mode == "headers" else plan
            ledger.reset()
            stopwatch.seconds, stopwatch.calls = 0.0, 0
            elapsed, cpu = _timed_step(engine, x, ga)
            if step >= len(MODES) * warmup:
                times[mode].append(elapsed)
                cpus[mode].append(cpu)
                inside[mode].append(stopwatch.spent())
                snaps.setdefault(mode, ledger.snapshot())
        for owner, name, checked, _ in patches:
            setattr(owner, name, checked)
        Communicator.defer = defer
        engine.close()
        medians = {m: statistics.median(t) for m, t in times.items()}
        # each checked step over the unchecked one right after it: load that drifts over
        # the run hits both sides of a pair alike
        medians["inside"] = statistics.median(inside["checked"])
        medians["unchecked cpu"] = statistics.median(cpus["unchecked"])
        for mode in ("checked", "synchronous"):   # the votes alone, deferred or not
            medians[f"{mode} voted pairs"] = statistics.median(
                c / u for c, u in zip(times[mode], times["unvoted"]))
        for mode in ("checked", "headers"):
            medians[f"{mode} pairs"] = statistics.median(
                c / u for c, u in zip(times[mode], times["unchecked"]))
            medians[f"{mode} cpu"] = statistics.median(
                c / u for c, u in zip(cpus[mode], cpus["unchecked"]))
        results[width] = (medians, snaps)
    return results


VOTE_MODES = ("checked", "unvoted", "unchecked")   # stages 0-2: a step each, in turn


def _bench_votes(rank, world, blocks, widths, steps, warmup, stage, ga=1):
    """Stages 0-2: two engines over equal models take turns step by step, "checked" (as
    shipped: votes, or none where a vote plan stands, engine/vote_plan.py) and one with
    ``"backward_votes": false``, run as "unvoted" (the fingerprint still on) and as
    "unchecked" (the collective trail patched out too). Two engines, because a plan needs
    consecutive equal cycles: steps of another mode in between would break it."""
    import torch
    from torch import nn

    import zerotrain
    from zerotrain.comm import trail as trail_mod
    torch.set_num_threads(1)
    note = trail_mod.CollectiveTrail.note
    results = {}
    for width in widths:
        engines = {}
        for votes in (True, False):
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                    for _ in range(blocks)])
            config = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10 ** 6,
                      "gradient_accumulation_steps": ga, "backward_votes": votes,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                      "zero_optimization": {"stage": stage, "overlap_comm": False}}
            engines[votes], *_ = zerotrain.initialize(model=model, config=config)
        x = torch.randn(16, width)
        times = {mode: [] for mode in VOTE_MODES}
        cpus = {mode: [] for mode in VOTE_MODES}
        snaps = {}
        for step in range(len(VOTE_MODES) * (steps + warmup)):
            mode = VOTE_MODES[step % len(VOTE_MODES)]
            engine = engines[mode == "checked"]
            trail_mod.CollectiveTrail.note = (lambda *a: None) if mode == "unchecked" else note
            ledger = engine.comm.ledger
            ledger.reset()
            elapsed, cpu = _timed_step(engine, x, ga)
            if step >= len(VOTE_MODES) * warmup:
                times[mode].append(elapsed)
                cpus[mode].append(cpu)
                snaps.setdefault(mode, (ledger.snapshot(), dict(ledger.host_reads)))
        trail_mod.CollectiveTrail.note = note
        planned = engines[True]._vote_plan is not None and engines[True]._vote_plan.plan
        for engine in engines.values():
            engine.close()
        medians = {m: statistics.median(t) for m, t in times.items()}
        for mode in ("unvoted", "unchecked"):
            medians[f"checked / {mode}"] = statistics.median(
                c / u for c, u in zip(times["checked"], times[mode]))
            medians[f"cpu checked / {mode}"] = statistics.median(
                c / u for c, u in zip(cpus["checked"], cpus[mode]))
        results[width] = (medians, snaps, bool(planned))
    return results


def _print_votes(args) -> None:
    print("| stage | ga | width | unchecked | unvoted | checked | checked / unchecked | "
          "checked / unvoted | CPU checked / unchecked, / unvoted | collectives per step "
          "checked, unvoted | host reads per step checked, unvoted | check bytes per step "
          "| plan stood |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for stage in args.stages:
        for ga in args.ga:
            per_width, *_ = run_world(_bench_votes, args.world, args.blocks, args.widths,
                                      args.steps, args.warmup, stage, ga, timeout=3600)
            for width, (t, snaps, planned) in per_width.items():
                calls = {m: sum(s["calls"].values()) for m, (s, _) in snaps.items()}
                reads = {m: sum(r.values()) for m, (_, r) in snaps.items()}
                check = snaps["checked"][0]["bytes"].get("divergence_check", 0)
                print(f"| {stage} | {ga} | {width} | {t['unchecked'] * 1e3:.2f} ms | "
                      f"{t['unvoted'] * 1e3:.2f} ms | {t['checked'] * 1e3:.2f} ms | "
                      f"{t['checked / unchecked']:.3f} | {t['checked / unvoted']:.3f} | "
                      f"{t['cpu checked / unchecked']:.3f}, {t['cpu checked / unvoted']:.3f} | "
                      f"{calls['checked']}, {calls['unvoted']} | "
                      f"{reads['checked']}, {reads['unvoted']} | {check} | {planned} |",
                      flush=True)


def _round_trip(rank, world, n=500, warmup=50):
    """Microseconds per lone all-reduce of a vote's six int64, launched and read at once,
    and launched asynchronously then waited for."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    wire, out = torch.zeros(6, dtype=torch.int64), {}
    for mode in ("synchronous", "asynchronous, waited at once"):
        for _ in range(warmup):
            dist.all_reduce(wire)
        start = time.perf_counter()
        for _ in range(n):
            if mode == "synchronous":
                dist.all_reduce(wire)
            else:
                dist.all_reduce(wire, async_op=True).wait()
            wire.tolist()
        out[mode] = (time.perf_counter() - start) / n * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps per mode")
    parser.add_argument("--stages", type=int, nargs="+", default=[3])
    parser.add_argument("--ga", type=int, nargs="+", default=[1],
                        help="gradient_accumulation_steps (stages 0-2: each in turn)")
    parser.add_argument("--round-trip", action="store_true",
                        help="time a lone vote-sized all-reduce instead")
    args = parser.parse_args()
    if args.round_trip:
        times = run_world(_round_trip, args.world, timeout=600)[0]
        print(f"{args.world} ranks (gloo), one all-reduce of 6 int64, load average "
              f"{os.getloadavg()[0]:.1f}: " + ", ".join(f"{m} {t:.0f} us"
                                                       for m, t in times.items()))
        return
    if all(stage < 3 for stage in args.stages):
        print(f"{args.world} ranks (gloo), {args.blocks} blocks of Linear(w, w) + Tanh, "
              f"batch 16, {args.steps} timed steps per mode, alternating; load average "
              f"{os.getloadavg()[0]:.1f}")
        _print_votes(args)
        return
    print(f"{args.world} ranks (gloo), {args.blocks} blocks of Linear(w, w) + Tanh, batch 16, "
          f"gradient_accumulation_steps {args.ga[0]}, "
          f"{args.steps} timed steps per mode, alternating; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| stage | width | unchecked | checked | checked / unchecked (median of pairs) | "
          "header launches, check bytes per step | headers only, no plan | "
          "headers / unchecked (median of pairs) | training thread CPU: checked / "
          "unchecked, headers / unchecked | checks' own code per checked step | "
          "checked / unvoted (median of pairs) | synchronous votes / unvoted | "
          "vote launches per step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for stage in args.stages:
        per_width, *_ = run_world(_bench, args.world, args.blocks, args.widths, args.steps,
                                  args.warmup, stage, args.ga[0], timeout=3600)
        for width, (times, snaps) in per_width.items():
            calls = {m: sum(s["calls"].values()) for m, s in snaps.items()}
            check = snaps["checked"]["bytes"].get("divergence_check", 0)
            print(f"| {stage} | {width} | {times['unchecked'] * 1e3:.2f} ms | "
                  f"{times['checked'] * 1e3:.2f} ms | {times['checked pairs']:.3f} | "
                  f"{calls['checked'] - calls['unchecked']}, {check} | "
                  f"{times['headers'] * 1e3:.2f} ms | {times['headers pairs']:.3f} | "
                  f"{times['checked cpu']:.3f}, {times['headers cpu']:.3f} | "
                  f"{times['inside'] * 1e6:.0f} us "
                  f"({100 * times['inside'] / times['unchecked cpu']:.2f}% of the unchecked step's "
                  f"CPU) | {times['checked voted pairs']:.3f} | "
                  f"{times['synchronous voted pairs']:.3f} | "
                  f"{calls['checked'] - calls['unvoted']} |")


if __name__ == "__main__":
    main()
