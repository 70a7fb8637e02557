"""One-GPU step time and memory of zerotrain's CPU/NVMe offload against plain PyTorch and FSDP2.

    python bench/offload_gpu.py                                  # GPT 1.4B, bf16, 8 x 1024
    python bench/offload_gpu.py --size 6.9b --cases fsdp2_offload,zt_z2_cpu,zt_z3_cpu
    python bench/offload_gpu.py --nvme-path /local_nvme          # adds zt_z2_nvme
    python bench/offload_gpu.py --size tiny --device cpu --steps 3   # smoke test anywhere

Each case runs in its own process (world size 1, so this measures what offload costs: host
copies, the CPU optimizer step, pinned buffers, not communication), under a timeout, and
prints one JSON line. A case that fails (out of memory, killed, timed out, raised) becomes a
"failed" row with the reason; the bench itself goes on. The markdown table at the end gives
seconds per step (median of the timed steps after the warm-up, each bracketed by
``torch.cuda.synchronize``), the ratio to ``plain`` measured in the same run (or, when plain
did not run, to the first case that did, named in the header), peak GPU memory
(``torch.cuda.max_memory_allocated`` over the whole process, init included), peak host RSS
(the child's ``ru_maxrss`` from ``os.wait4``, so killed cases have one too), the seconds from
start of build to the first step, and the final loss.

How each case builds the model and trains (all use one fixed batch of random tokens from a
seeded CPU generator, AdamW lr 1e-4 / weight decay 0.01, and the same GPT, ``gpt_model.py``,
with an untied head):

- ``plain``: built directly on the device in fp32 (autocast needs fp32 weights), autocast
  bf16, fused AdamW on the device. No offload: the baseline. The 6.9B model cannot fit on
  an 80 GB GPU this way (16 bytes/parameter before activations); leave it out with --cases.
- ``fsdp2_offload``: built on the meta device, ``fully_shard`` per block and at the root with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and
  ``CPUOffloadPolicy(pin_memory=True)`` over a world-size-1 NCCL group, then ``to_empty`` on
  the CPU and each module's ``reset_parameters`` run on its local shard (the whole parameter
  at world size 1). Sharded fp32 parameters, gradients and AdamW state (fused, on the CPU)
  stay in host memory; torch's own peer. Needs CUDA: skipped with --device cpu.
- ``zt_z2_cpu``: built directly on the device in bf16 (zerotrain casts to bf16 anyway), then
  stage 2 with ``offload_optimizer: {device: cpu, pin_memory: true}``.
- ``zt_z3_cpu``: built on the CPU in bf16 under ``zerotrain.zero.Init(remote_device="cpu",
  pin_memory=True)`` (pinned only where CUDA is there), so each module is partitioned as it is constructed and the full model
  never exists twice; stage 3 with ``offload_param`` and ``offload_optimizer`` to the CPU.
- ``zt_z2_nvme`` (only with --nvme-path): as ``zt_z2_cpu`` with ``offload_optimizer:
  {device: nvme, nvme_path: ...}``.

``--dpu`` adds ``"dpu": true`` (the one-step delayed parameter update) to every zerotrain
case's ``offload_optimizer``; ``--speculative`` adds ``"speculative": true`` (the host step
taken during backward, validated after it) and ``--trace DIR`` writes each zerotrain case's
per-record host-step timeline to ``DIR/<case>.json`` (a Chrome trace, docs/offload.md);
``--ratio R`` keeps ``1 - R`` of ``zt_z2_cpu``'s optimizer on the GPU (``offload_optimizer.ratio``). Warnings from ``zerotrain.initialize`` that mention offload go
to the table's notes column: a config that silently trains without offload must not pass
for one that offloads.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_model import GPT  # noqa: E402  (bench/ is not a package)

SIZES = {  # model shape, then the defaults of --vocab/--seq/--batch for that size
    "1.4b": dict(model=dict(d_model=2048, n_layer=24, n_head=16), vocab=50304, seq=1024, batch=8,
                 grad_accum="fp32", recompute=False),
    # 6.9B: 16-bit gradient accumulation (13.7 GB instead of 27.4 GB of fp32 gradient on the
    # GPU) and recomputed blocks (36 GB of activations otherwise) so it fits 80 GB
    "6.9b": dict(model=dict(d_model=4096, n_layer=32, n_head=32), vocab=50304, seq=1024, batch=8,
                 grad_accum="bf16", recompute=True),
    "tiny": dict(model=dict(d_model=64, n_layer=2, n_head=2), vocab=512, seq=64, batch=2,
                 grad_accum="fp32", recompute=False),
}
CASES = {
    "plain": "plain PyTorch, autocast bf16, fused AdamW on the GPU, no offload",
    "fsdp2_offload": "FSDP2 fully_shard, bf16 MixedPrecisionPolicy, CPUOffloadPolicy",
    "zt_z2_cpu": "zerotrain stage 2, bf16, offload_optimizer cpu",
    "zt_z3_cpu": "zerotrain stage 3, bf16, offload_param + offload_optimizer cpu",
    "zt_z2_nvme": "zerotrain stage 2, bf16, offload_optimizer nvme",
}
LR, WEIGHT_DECAY = 1e-4, 0.01
RESULT = "RESULT "  # prefix of the child's JSON line on stdout
GIB = 2**30


# ----------------------------------------------------------------- one case (child process)
@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def new_gpt(args) -> GPT:
    return GPT(**SIZES[args.size]["model"], seq=args.seq, vocab=args.vocab, tie_head=False,
               recompute=args.recompute)


def zerotrain_config(case: str, args) -> dict:
    offload_optimizer = {"device": "cpu", "pin_memory": True}
    if case == "zt_z2_nvme":
        offload_optimizer = {"device": "nvme", "nvme_path": args.nvme_path, "pin_memory": True}
    if args.dpu:
        offload_optimizer["dpu"] = True
    if args.speculative:
        offload_optimizer["speculative"] = True
    if args.ratio is not None and case == "zt_z2_cpu":
        offload_optimizer["ratio"] = args.ratio
    if args.trace:
        offload_optimizer["trace_path"] = os.path.join(args.trace, f"{case}.json")
    zero = {"stage": 3 if case == "zt_z3_cpu" else 2, "overlap_comm": True,
            "offload_optimizer": offload_optimizer}
    if case == "zt_z3_cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "steps_per_print": 10**9, "zero_optimization": zero,
            "data_types": {"grad_accum_dtype": args.grad_accum},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}}


def build_plain(args, device):
    with torch.device(device):  # fp32 weights straight on the device: autocast casts them
        model = new_gpt(args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step, []


@torch.no_grad()
def reset_local_shards(model) -> None:
    """Run each module's ``reset_parameters`` on its DTensor parameters' local tensors.

    At world size 1 a local shard is the whole parameter, so this gives the initialisation
    of plain construction; the local tensors alias the DTensors' storage.
    """
    for module in model.modules():
        if not hasattr(module, "reset_parameters"):
            continue
        saved = dict(module._parameters)
        module._parameters.update({n: p.to_local() for n, p in saved.items() if p is not None})
        try:
            module.reset_parameters()
        finally:
            module._parameters.update(saved)


def build_fsdp2(args, device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    with torch.device("meta"):
        model = new_gpt(args)
    policy = dict(mesh=init_device_mesh(device.type, (1,)),
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"))
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    model.to_empty(device="cpu")  # sharded parameters live on the host (CPUOffloadPolicy)
    reset_local_shards(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step, []


def build_zerotrain(case: str, args, device):
    import zerotrain

    config = zerotrain_config(case, args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "zt_z3_cpu":  # partitioned module by module, on the host, in bf16
            with zerotrain.zero.Init(remote_device="cpu", pin_memory=device.type == "cuda",
                                     config_dict_or_path=config), default_dtype(torch.bfloat16):
                model = new_gpt(args)
        else:
            with torch.device(device), default_dtype(torch.bfloat16):
                model = new_gpt(args)
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
    notes = [str(w.message) for w in caught if "offload" in str(w.message).lower()]
    for w in caught:
        print(f"warning: {w.category.__name__}: {w.message}", file=sys.stderr)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    return step, notes


def run_case(case: str, args) -> dict:
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    start = time.perf_counter()
    if case == "plain":
        step, notes = build_plain(args, device)
    elif case == "fsdp2_offload":
        step, notes = build_fsdp2(args, device)
    else:
        step, notes = build_zerotrain(case, args, device)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1234))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].contiguous().to(device)
    init_s = time.perf_counter() - start
    times, loss = [], None
    for _ in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(x, y)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    timed = times[args.warmup:]
    return {"case": case, "s_per_step": statistics.median(timed), "step_times": timed,
            "init_s": init_s, "final_loss": float(loss.item()),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
            "notes": notes}


# ----------------------------------------------------------------- the bench (parent process)
def child_env(args) -> dict:
    """World size 1 without a rendezvous: drop launcher variables; hide GPUs for --device cpu."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
           and not k.startswith("TORCHELASTIC_")}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def failure_reason(rc: int, timed_out: bool, stderr: str, timeout: float) -> str:
    if timed_out:
        return f"timed out after {timeout:.0f} s"
    if rc < 0:
        name = signal.Signals(-rc).name
        return f"killed by {name}" + (" (host out of memory?)" if name == "SIGKILL" else "")
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return f"exit {rc}: {lines[-1] if lines else 'no stderr'}"


def run_child(case: str, args) -> dict:
    """Run one case in a new process session under ``--timeout``; always returns a row."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case", case] + sys.argv[1:]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=child_env(args),
                                start_new_session=True)
        deadline, timed_out = time.monotonic() + args.timeout, False
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    _, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.2)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session
            raise
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    rss_gib = usage.ru_maxrss * 1024 / GIB
    results = [line[len(RESULT):] for line in stdout.splitlines() if line.startswith(RESULT)]
    if rc == 0 and not timed_out and results:
        return dict(json.loads(results[-1]), peak_rss_gib=rss_gib)
    return {"case": case, "failed": failure_reason(rc, timed_out, stderr, args.timeout),
            "returncode": rc, "peak_rss_gib": rss_gib, "stderr_tail": stderr.splitlines()[-8:]}


def skip_reason(case: str, args):
    if case == "fsdp2_offload" and args.device != "cuda":
        return "skipped: needs CUDA (it offloads from a GPU to pinned host memory)"
    if case == "zt_z2_nvme" and not args.nvme_path:
        return "skipped: needs --nvme-path"
    return None


def machine_line(args) -> str:
    import zerotrain
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() \
        else "no GPU (--device cpu)"
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return (f"{gpu}; host {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}),"
            f" {host_gib:.0f} GiB; torch {torch.__version__}, zerotrain {zerotrain.__version__}")


def model_line(args) -> str:
    with torch.device("meta"):
        numel = sum(p.numel() for p in new_gpt(args).parameters())
    shape = SIZES[args.size]["model"]
    count = f"{numel / 1e9:.2f}B" if numel >= 1e9 else f"{numel / 1e6:.2f}M"
    return (f"GPT {args.size}: {count} parameters ({shape['n_layer']} layers, "
            f"d_model {shape['d_model']}, {shape['n_head']} heads, vocab {args.vocab}, untied "
            f"head), bf16, micro-batch {args.batch} x {args.seq}; {args.warmup} warm-up + "
            f"{args.steps} timed steps (median); zerotrain gradients accumulate in "
            f"{args.grad_accum}{'; blocks recomputed in backward' if args.recompute else ''}"
            f"{'; --dpu' if args.dpu else ''}{'; --speculative' if args.speculative else ''}")


def fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if "s_per_step" in r]
    base = next((r for r in ok if r["case"] == "plain"), ok[0] if ok else None)
    lines = [f"| case | s/step | ratio to {base['case'] if base else 'plain'} | peak GPU GiB "
             "| peak host RSS GiB | init s | final loss | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "s_per_step" not in r:
            reason = r.get("failed") or r.get("skipped", "")
            status = reason if reason.startswith("skipped") else f"failed: {reason}"
            status = status.replace("|", "\\|")[:200]
            lines.append(f"| {r['case']} | | | | {fmt(r.get('peak_rss_gib'), '.1f')} | | | "
                         f"{status} |")
            continue
        ratio = r["s_per_step"] / base["s_per_step"]
        notes = "; ".join(r.get("notes", [])).replace("|", "\\|")[:200]
        lines.append(f"| {r['case']} | {r['s_per_step']:.3f} | {ratio:.2f} | "
                     f"{fmt(r['peak_gpu_gib'], '.1f') or 'n/a'} | {r['peak_rss_gib']:.1f} | "
                     f"{r['init_s']:.1f} | {r['final_loss']:.4f} | {notes} |")
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.4b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cases", help="comma-separated subset of: " + ", ".join(CASES) +
                        " (default: all but zt_z2_nvme, which --nvme-path adds)")
    parser.add_argument("--batch", type=int, help="micro-batch (default: the size's)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the size's)")
    parser.add_argument("--vocab", type=int, help="vocabulary (default: the size's)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per case")
    parser.add_argument("--nvme-path", help="directory on an NVMe drive; adds zt_z2_nvme")
    parser.add_argument("--dpu", action="store_true",
                        help='add "dpu": true to offload_optimizer in zerotrain cases')
    parser.add_argument("--speculative", action="store_true",
                        help='add "speculative": true to offload_optimizer in zerotrain cases')
    parser.add_argument("--ratio", type=float, metavar="R",
                        help='add "ratio": R (the share of the optimizer stepped on the host; '
                             'docs/offload.md, "With ratio") to zt_z2_cpu')
    parser.add_argument("--trace", metavar="DIR",
                        help="write each zerotrain case's host-step timeline to DIR/<case>.json")
    parser.add_argument("--grad-accum", choices=("fp32", "bf16"),
                        help="zerotrain's data_types.grad_accum_dtype (default: the size's)")
    parser.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                        help="activation checkpointing of every block, in every case "
                        "(default: the size's)")
    parser.add_argument("--json-out", help="also write the rows to this JSON file")
    parser.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key in ("batch", "seq", "vocab", "grad_accum", "recompute"):
        if getattr(args, key) is None:
            setattr(args, key, SIZES[args.size][key])
    default = [c for c in CASES if c != "zt_z2_nvme" or args.nvme_path]
    args.case_list = args.cases.split(",") if args.cases else default
    unknown = [c for c in args.case_list if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    return args


def main() -> int:
    args = parse_args()
    if args.case:
        print(RESULT + json.dumps(run_case(args.case, args)), flush=True)
        return 0
    print("command:", shlex.join([sys.executable] + sys.argv), flush=True)
    print(machine_line(args), flush=True)
    print(model_line(args), flush=True)
    rows = []
    for case in args.case_list:
        skipped = skip_reason(case, args)
        rows.append({"case": case, "skipped": skipped} if skipped else run_child(case, args))
        print(json.dumps(rows[-1]), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"command": sys.argv, "machine": machine_line(args),
                       "model": model_line(args), "rows": rows}, f, indent=1)
    print(f"\n{machine_line(args)}\n{model_line(args)}\n")
    print("\n".join(table(rows)))
    print("\n" + "\n".join(f"- `{c}`: {CASES[c]}" for c in args.case_list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
