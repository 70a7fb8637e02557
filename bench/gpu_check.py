"""The first thing to run on a GPU machine: one command, a few minutes, every step bounded.

    make gpu-check                     # on one H100/H200: about 6-7 minutes (BUDGET_S=450)
    DRY_RUN=1 make gpu-check           # anywhere: every step's logic on CPU, tiny sizes
    python bench/gpu_check.py --only env,stages --budget 200    # a rerun of some steps

Steps, in order, each in its own process group under its own timeout (at most what the
whole budget has left), each printing one line ``[gpu-check] <step> ok|FAILED|TIMEOUT <s>
<result>``:

* ``wheels``: pydantic and its dependencies from the carried ``.whl/`` folder (``make
  gpu-wheels``) into ``$SITE`` with ``pip install --no-index --target``, when the machine
  lacks them; later steps put ``$SITE`` and ``src`` on ``PYTHONPATH`` (nothing is built);
* ``env``: GPU, torch, CUDA, NCCL, cores and threads, pydantic and zerotrain as imported,
  pinned host-to-device and device-to-host GB/s;
* ``pytest``: ``pytest -m gpu tests/gpu`` (junit XML in ``$OUT``);
* ``stages``: plain PyTorch and stages 0-3 at world size 1 on a 1.3B GPT (bf16 parameters,
  fp32 masters and Adam), 20 timed steps after 3 warm-up steps, timed with CUDA events,
  peak allocated and reserved memory; one process per case;
* ``offload``: ``bench/offload_gpu.py`` on the 1.42B model (plain, zt_z2_cpu, zt_z3_cpu);
* ``breakdown``: zt_z2_cpu and zt_z3_cpu again in-process, for ``engine.timing_breakdown()``
  (forward, backward, step and the host step's parts), the copy ledger and peak reserved;
* ``deepspeed``: the same stages under DeepSpeed, only when it imports there.

``$OUT`` (default ``/tmp/gpu_check``) receives four files: ``summary.jsonl`` (one JSON line
per step, written as each ends, so a killed run keeps what it finished), ``report.md`` (the
tables for docs/BENCHMARKS.md, with the card named), ``gpu_check.log`` (every step's output)
and ``pytest.xml``. ``DRY_RUN=1`` (or ``--dry-run``) runs the same steps on the CPU with a
tiny GPT and 1-3 steps, several cases per process, to prove the script before a GPU run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STEPS = ("wheels", "env", "pytest", "stages", "offload", "breakdown", "deepspeed")
# seconds per step on one H100 (each also bounded by what the budget has left)
CAPS = {"wheels": 60, "env": 60, "pytest": 180, "stages": 45, "offload": 200,
        "breakdown": 120, "deepspeed": 120}
STAGE_CASES = ("plain", "stage0", "stage1", "stage2", "stage3")
OFFLOAD_CASES = ("zt_z2_cpu", "zt_z3_cpu")
GIB = 2 ** 30


# ===================================================================== child: one case
def _sizes(dry: bool) -> dict:
    if dry:
        return dict(model=dict(d_model=64, n_layer=2, n_head=2), vocab=512, seq=64, batch=2,
                    warmup=1, steps=2)
    return dict(model=dict(d_model=2048, n_layer=24, n_head=16), vocab=50304, seq=1024,
                batch=8, warmup=3, steps=20)


class _Clock:
    """Step times from CUDA events on a GPU (Note: timing on a GPU, timers.py), else wall."""

    def __init__(self, cuda: bool) -> None:
        import torch
        self.torch, self.cuda = torch, cuda

    def time(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _stage_config(case: str, batch: int) -> dict:
    zero = {"stage": int(case.removeprefix("stage")), "overlap_comm": True,
            "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
    return {"train_micro_batch_size_per_gpu": batch, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "steps_per_print": 10 ** 9, "zero_optimization": zero}


def stage_case(case: str, dry: bool) -> dict:
    """Plain PyTorch or one stage at world size 1: seconds per step and peak memory."""
    import torch
    sys.path.insert(0, HERE)
    from gpt_model import GPT
    from zero_gpu import _plain

    size = _sizes(dry)
    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    with torch.device(device):   # built where it trains: no host copy of 1.3B first
        model = GPT(**size["model"], seq=size["seq"], vocab=size["vocab"])
    idx = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device)
    if case == "plain":
        step = _plain(model, device, 1)
    else:
        import zerotrain
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(),
                                          config=_stage_config(case, size["batch"]))

        def step(batch):
            engine.backward(engine(batch, batch))
            engine.step()
    clock = _Clock(cuda)
    times = [clock.time(lambda: step(idx)) for _ in range(size["warmup"] + size["steps"])]
    timed = times[size["warmup"]:]
    row = {"case": case, "s_per_step": statistics.median(timed), "timed_steps": len(timed),
           "timer": "cuda events" if cuda else "wall"}
    if cuda:
        row.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                   peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                   alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0))
    return row


def breakdown_case(case: str, dry: bool) -> dict:
    """An offload case of offload_gpu.py (its config and model) in this process, so that
    ``engine.timing_breakdown()`` says where the step goes."""
    import torch
    sys.path.insert(0, HERE)
    import offload_gpu as B
    import zerotrain

    argv = ["--size", "tiny", "--device", "cpu"] if dry else ["--size", "1.4b"]
    args = B.parse_args(argv + ["--cases", case])
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    config = B.zerotrain_config(case, args)
    if case == "zt_z3_cpu":
        with zerotrain.zero.Init(remote_device="cpu", pin_memory=cuda,
                                 config_dict_or_path=config), B.default_dtype(torch.bfloat16):
            model = B.new_gpt(args)
    else:
        with torch.device(device), B.default_dtype(torch.bfloat16):
            model = B.new_gpt(args)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1234))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].contiguous().to(device)

    def step():
        engine.backward(engine(x, y))
        engine.step()
    clock = _Clock(cuda)
    warmup, steps = (1, 2) if dry else (2, 5)
    for _ in range(warmup):
        clock.time(step)
    engine.timing_breakdown()        # counting starts afresh after the warm-up
    engine.copy_ledger.reset()
    timed = [clock.time(step) for _ in range(steps)]
    parts = engine.timing_breakdown()
    row = {"case": case, "s_per_step": statistics.median(timed),
           "breakdown_s_per_step": {k: v / steps for k, v in parts.items()},
           "copies_per_step_bytes": {k: v // steps
                                     for k, v in engine.copy_ledger.nbytes.items()},
           "memory_bytes": engine.memory_breakdown()}
    if cuda:
        row.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                   peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
    engine.close()
    return row


def env_facts(dry: bool) -> dict:
    """The machine, what imports, and the pinned copy rates that bound offload."""
    info: dict = {"python": sys.version.split()[0],
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
                  "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}
    import torch
    info.update(torch=torch.__version__, cuda=torch.cuda.is_available(),
                torch_threads=torch.get_num_threads())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_gib=round(p.total_memory / GIB, 1),
                    capability=f"{p.major}.{p.minor}", cuda_version=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    import pydantic
    import zerotrain
    info.update(pydantic=pydantic.VERSION, zerotrain=zerotrain.__version__,
                zerotrain_file=zerotrain.__file__)
    n = 1 << 20 if dry else 1 << 28           # 2**28 bf16 elements: 512 MiB each way
    if torch.cuda.is_available() and not dry:
        host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        clock = _Clock(True)
        for name, fn in (("h2d_pinned_GBs", lambda: dev.copy_(host, non_blocking=True)),
                         ("d2h_pinned_GBs", lambda: host.copy_(dev, non_blocking=True))):
            fn()
            info[name] = round(2 * n / min(clock.time(fn) for _ in range(3)) / 1e9, 1)
    else:                                      # the same arithmetic over a host copy
        a, b = torch.empty(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
        t = min(_Clock(False).time(lambda: a.copy_(b)) for _ in range(3))
        info["host_copy_GBs"] = round(2 * n / max(t, 1e-9) / 1e9, 1)
    return info


def child_main(kind: str, cases: list[str], out_dir: str, dry: bool) -> int:
    """One process: each case's row (or its error) into ``out_dir/<kind>_<case>.json``."""
    run = {"stage": stage_case, "breakdown": breakdown_case}.get(kind)
    for case in cases:
        try:
            row = env_facts(dry) if kind == "env" else run(case, dry)
        except Exception as exc:   # noqa: BLE001 - the row says why; the next case runs
            row = {"case": case, "error": f"{type(exc).__name__}: {exc}"[-600:]}
        with open(os.path.join(out_dir, f"{kind}_{case}.json"), "w") as f:
            json.dump(row, f, default=str)
        print(f"{kind} {case}: {json.dumps(row, default=str)[:300]}", flush=True)
    return 0


# ===================================================================== parent: the steps
class Check:
    """Runs the steps in order within one budget; one line and one JSON line per step."""

    def __init__(self, out: str, budget: float, dry: bool, python: str, site: str,
                 wheels: str) -> None:
        self.out, self.budget, self.dry, self.python = out, budget, dry, python
        self.site, self.wheels = site, wheels
        self.start = time.monotonic()
        self.work = tempfile.mkdtemp(prefix="gpu_check_")   # per-case rows, not sent back
        os.makedirs(out, exist_ok=True)
        self.log = open(os.path.join(out, "gpu_check.log"), "a")
        self.summary = os.path.join(out, "summary.jsonl")
        open(self.summary, "w").close()
        self.results: dict[str, dict] = {}
        path = [site, os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p),
                        PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
            self.env.pop(key, None)          # world size 1, no rendezvous
        if dry:
            self.env["CUDA_VISIBLE_DEVICES"] = ""

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def run(self, cmd: list[str], cap: float) -> tuple[int, bool, str]:
        """``cmd`` in its own process group under ``min(cap, budget left)``; on timeout the
        whole group is killed (by its id). Returns (returncode, timed_out, output)."""
        limit = max(1.0, min(cap, self.left() - 5))
        self.log.write(f"\n$ {shlex.join(cmd)}   # limit {limit:.0f} s\n")
        self.log.flush()
        with tempfile.TemporaryFile("w+") as buf:
            proc = subprocess.Popen(cmd, stdout=buf, stderr=subprocess.STDOUT, env=self.env,
                                    cwd=REPO, start_new_session=True)
            try:
                rc, timed_out = proc.wait(timeout=limit), False
            except subprocess.TimeoutExpired:
                rc, timed_out = 124, True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)   # leftovers of the step too
                except ProcessLookupError:
                    pass
                proc.wait()
            buf.seek(0)
            output = buf.read()
        self.log.write(output)
        self.log.flush()
        return rc, timed_out, output

    def child(self, kind: str, cases: list[str], cap: float) -> tuple[int, bool, str]:
        cmd = [self.python, os.path.abspath(__file__), "--child", kind, "--work", self.work,
               *(["--dry-run"] if self.dry else []), *cases]
        return self.run(cmd, cap)

    def rows(self, kind: str, cases: list[str], why: str) -> list[dict]:
        out = []
        for case in cases:
            try:
                with open(os.path.join(self.work, f"{kind}_{case}.json")) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                out.append({"case": case, "error": why})
        return out

    def note(self, step: str, status: str, seconds: float, text: str, figures: dict) -> None:
        line = f"[gpu-check] {step:<9} {status:<7} {seconds:5.0f}s  {text}"
        print(line[:1200], flush=True)
        self.results[step] = {"step": step, "status": status, "seconds": round(seconds, 1),
                              "text": text, "figures": figures}
        with open(self.summary, "a") as f:
            f.write(json.dumps(self.results[step], default=str) + "\n")

    # ------------------------------------------------------------------ steps
    def step_wheels(self, cap: float):
        probe = [self.python, "-c", "import pydantic, annotated_types, typing_inspection; "
                 "print(pydantic.VERSION)"]
        rc, _, output = self.run(probe, 30)
        if rc == 0:
            return "ok", f"pydantic {output.strip().splitlines()[-1]} already importable", {}
        wheels = sorted(os.path.join(self.wheels, f) for f in os.listdir(self.wheels)
                        if f.endswith(".whl")) if os.path.isdir(self.wheels) else []
        if not wheels:
            return "FAILED", f"no pydantic here and no wheels in {self.wheels} (make gpu-wheels)", {}
        rc, timed_out, output = self.run(
            [self.python, "-m", "pip", "install", "-q", "--no-index", "--no-cache-dir",
             "--no-compile", "--upgrade", "--target", self.site, *wheels], cap)
        if rc != 0:
            return _status(rc, timed_out), "pip install failed: " + _tail(output), {}
        rc, _, output = self.run(probe, 30)
        names = [os.path.basename(w) for w in wheels]
        return (("ok", f"installed {len(names)} wheels into {self.site}", {"wheels": names})
                if rc == 0 else ("FAILED", "installed but pydantic does not import: "
                                 + _tail(output), {"wheels": names}))

    def step_env(self, cap: float):
        rc, timed_out, output = self.child("env", ["facts"], cap)
        row = self.rows("env", ["facts"], _tail(output))[0]
        if "error" in row or rc != 0:
            return _status(rc or 1, timed_out), "import failed: " + row.get("error", ""), row
        rates = ", ".join(f"{k} {row[k]}" for k in ("h2d_pinned_GBs", "d2h_pinned_GBs",
                                                   "host_copy_GBs") if k in row)
        text = (f"{row.get('gpu', 'no GPU')}; torch {row['torch']}; python {row['python']}; "
                f"zerotrain {row['zerotrain']}; pydantic {row['pydantic']}; cpus "
                f"{row['affinity']}, torch threads {row['torch_threads']}; {rates}")
        return "ok", text, row

    def step_pytest(self, cap: float):
        xml = os.path.join(self.out, "pytest.xml")
        rc, timed_out, output = self.run(
            [self.python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
             f"--junitxml={xml}", "tests/gpu"], cap)
        counts = _junit(xml)
        if counts is None:
            return _status(rc or 1, timed_out), "no junit XML: " + _tail(output), {}
        bad = [f"{c['name']}: {c['message'][-160:]}" for c in counts["cases"]
               if c["outcome"] in ("failed", "error")]
        text = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} "
                f"errors, {counts['skipped']} skipped" + "".join(" | " + b for b in bad))
        ok = rc in (0, 5) and not bad and not timed_out   # 5: all deselected
        return ("ok" if ok else _status(rc or 1, timed_out)), text, counts

    def step_stages(self, cap: float):
        rows = []
        if self.dry:   # one process for all cases: the same code, a fraction of the time
            rc, timed_out, output = self.child("stage", list(STAGE_CASES), cap)
            rows = self.rows("stage", list(STAGE_CASES), _why(rc, timed_out, output))
        else:
            for case in STAGE_CASES:
                rc, timed_out, output = self.child("stage", [case], cap)
                rows += self.rows("stage", [case], _why(rc, timed_out, output))
        return _rows_result(rows)

    def step_offload(self, cap: float):
        out = os.path.join(self.work, "offload.json")
        argv = (["--size", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "2",
                 "--cases", "zt_z2_cpu"] if self.dry else
                ["--size", "1.4b", "--warmup", "2", "--steps", "6",
                 "--cases", "plain," + ",".join(OFFLOAD_CASES), "--timeout", "90"])
        rc, timed_out, output = self.run(
            [self.python, os.path.join(HERE, "offload_gpu.py"), *argv, "--json-out", out], cap)
        try:
            with open(out) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return _status(rc or 1, timed_out), "no rows: " + _tail(output), {}
        status, text, figures = _rows_result(
            [dict(r, error=r.get("failed")) if "failed" in r else r for r in data["rows"]])
        figures.update(machine=data.get("machine"), model=data.get("model"))
        return status, text, figures

    def step_breakdown(self, cap: float):
        cases = list(OFFLOAD_CASES)
        if self.dry:
            rc, timed_out, output = self.child("breakdown", cases, cap)
            rows = self.rows("breakdown", cases, _why(rc, timed_out, output))
        else:
            rows = []
            for case in cases:
                rc, timed_out, output = self.child("breakdown", [case], cap / len(cases))
                rows += self.rows("breakdown", [case], _why(rc, timed_out, output))
        status, text, figures = _rows_result(rows, base=None)
        parts = []
        for r in rows:
            if "breakdown_s_per_step" in r:
                top = sorted(r["breakdown_s_per_step"].items(), key=lambda kv: -kv[1])[:6]
                parts.append(f"{r['case']}: " + ", ".join(f"{k} {v:.3f}" for k, v in top))
        return status, text + ("" if not parts else " || " + " | ".join(parts)), figures

    def step_deepspeed(self, cap: float):
        rc, _, output = self.run([self.python, "-c", "import deepspeed"], 60)
        if rc != 0:
            return "skipped", "DeepSpeed does not import here: " + _tail(output, 1), {}
        argv = (["--size", "tiny", "--device", "cpu", "--steps", "3", "--batch", "2",
                 "--seq", "64"] if self.dry else ["--size", "1.3b", "--steps", "12"])
        rc, timed_out, output = self.run(
            [self.python, os.path.join(HERE, "zero_gpu.py"), *argv,
             "--cases", "ds_stage1,ds_stage2,ds_stage3"], cap)
        rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        if not rows:
            return _status(rc or 1, timed_out), "no rows: " + _tail(output), {}
        return _rows_result(rows, base=None)

    # ------------------------------------------------------------------ the whole
    def main(self, steps: list[str]) -> int:
        failed = 0
        for step in steps:
            t0 = time.monotonic()
            if self.left() < 20:
                self.note(step, "skipped", 0, f"budget of {self.budget:.0f} s spent", {})
                continue
            try:
                cap = max(CAPS[step], 150) if self.dry else CAPS[step]   # shared CPUs
                status, text, figures = getattr(self, f"step_{step}")(cap)
            except Exception as exc:   # noqa: BLE001 - a broken step must not stop the rest
                status, text, figures = "FAILED", f"{type(exc).__name__}: {exc}", {}
            self.note(step, status, time.monotonic() - t0, text, figures)
            failed += status not in ("ok", "skipped")
            if step in ("wheels", "env") and status != "ok":
                print("[gpu-check] zerotrain cannot be imported; the other steps would fail "
                      "the same way", flush=True)
                failed += 1
                break
        with open(os.path.join(self.out, "report.md"), "w") as f:
            f.write(report(self.results, self.dry))
        print(f"[gpu-check] done in {time.monotonic() - self.start:.0f}s; {failed} step(s) "
              f"failed; files in {self.out}", flush=True)
        return 1 if failed else 0


# ===================================================================== results
def _status(rc: int, timed_out: bool) -> str:
    return "TIMEOUT" if timed_out else ("ok" if rc == 0 else "FAILED")


def _tail(output: str, n: int = 2) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return " / ".join(lines[-n:])[-300:] or "no output"


def _why(rc: int, timed_out: bool, output: str) -> str:
    return "timed out" if timed_out else f"exit {rc}: {_tail(output)}"


def _rows_result(rows: list[dict], base: Optional[str] = "plain"):
    """Status, one line of text and the figures of a table of cases."""
    by_case = {r["case"]: r for r in rows}
    plain = by_case.get(base, {}).get("s_per_step") if base else None
    parts = []
    for r in rows:
        if "s_per_step" not in r:
            parts.append(f"{r['case']} FAILED ({str(r.get('error') or r.get('skipped'))[-160:]})")
            continue
        ratio = f" ({r['s_per_step'] / plain:.2f}x)" if plain else ""
        peak = r.get("peak_allocated_gib") or r.get("peak_gpu_gib")
        parts.append(f"{r['case']} {r['s_per_step']:.3f}s{ratio}"
                     + (f" {peak:.1f}GiB" if isinstance(peak, float) else ""))
    failed = any("s_per_step" not in r and not r.get("skipped") for r in rows) or not rows
    return ("FAILED" if failed else "ok"), " | ".join(parts), {"rows": rows}


def _junit(path: str) -> Optional[dict]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts: dict = {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "cases": []}
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                outcome = name
                message = f"{el.get('message') or ''} {el.text or ''}".strip()
                break
        counts[outcome] += 1
        counts["cases"].append({"name": case.get("name"), "outcome": outcome,
                                "seconds": float(case.get("time", 0)),
                                "message": message[-700:]})
    return counts


def report(results: dict[str, dict], dry: bool) -> str:
    """Markdown for docs/BENCHMARKS.md: the card, then one table per measured step."""
    env = results.get("env", {}).get("figures", {})
    card = env.get("gpu", "CPU (dry run)" if dry else "no GPU")
    lines = [f"## First GPU check: {card}", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda_version')}, python "
             f"{env.get('python')}, {env.get('affinity')} cores; pinned H2D "
             f"{env.get('h2d_pinned_GBs')} GB/s, D2H {env.get('d2h_pinned_GBs')} GB/s. "
             "Command: `make gpu-check`." + (" DRY RUN: tiny sizes on CPU, figures "
                                             "meaningless." if dry else ""), "",
             "| step | status | s | result |", "|---|---|---|---|"]
    for r in results.values():
        lines.append(f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | "
                     f"{r['text'].replace('|', '/')[:400]} |")
    for step, title in (("stages", "World size 1, GPT 1.3B, bf16, micro-batch 8 x 1024"),
                        ("offload", "Offload, GPT 1.42B (the anchors' configuration)"),
                        ("deepspeed", "DeepSpeed, GPT 1.3B")):
        rows = results.get(step, {}).get("figures", {}).get("rows", [])
        ok = [r for r in rows if "s_per_step" in r]
        if not ok:
            continue
        plain = next((r["s_per_step"] for r in ok if r["case"] == "plain"), None)
        lines += ["", f"### {'DRY RUN, tiny GPT on CPU, not ' if dry else ''}{title}", "",
                  "| case | s/step | ratio to plain | peak allocated GiB | peak reserved GiB |",
                  "|---|---|---|---|---|"]
        for r in ok:
            ratio = f"{r['s_per_step'] / plain:.2f}" if plain else ""
            peak = r.get("peak_allocated_gib", r.get("peak_gpu_gib"))
            lines.append(f"| {r['case']} | {r['s_per_step']:.3f} | {ratio} | {_num(peak)} | "
                         f"{_num(r.get('peak_reserved_gib'))} |")
    rows = results.get("breakdown", {}).get("figures", {}).get("rows", [])
    for r in rows:
        if "breakdown_s_per_step" in r:
            lines += ["", f"### Where a {r['case']} step goes (s per step, "
                      "engine.timing_breakdown())", "", "| part | s |", "|---|---|"]
            lines += [f"| {k} | {v:.4f} |" for k, v in sorted(
                r["breakdown_s_per_step"].items(), key=lambda kv: -kv[1])]
    return "\n".join(lines) + "\n"


def _num(value) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        default=os.environ.get("DRY_RUN", "0") not in ("", "0"),
                        help="tiny sizes on the CPU (also DRY_RUN=1)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_check")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("BUDGET_S", 450)),
                        help="seconds for the whole check (default 450, or BUDGET_S)")
    parser.add_argument("--only", default=os.environ.get("GC_STEPS", ""),
                        help="comma-separated steps, in order (default: all): " + ",".join(STEPS))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--site", default=os.environ.get("SITE", "/tmp/gpu_check_site"))
    parser.add_argument("--wheels", default=os.path.join(REPO, ".whl"))
    parser.add_argument("--child", choices=("env", "stage", "breakdown"), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("cases", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child, args.cases, args.work, args.dry_run)
    steps = [s for s in args.only.replace(" ", ",").split(",") if s] or list(STEPS)
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown step(s) {unknown}; the steps are {', '.join(STEPS)}")
    return Check(args.out, args.budget, args.dry_run, args.python, args.site,
                 args.wheels).main(steps)


if __name__ == "__main__":
    sys.exit(main())
