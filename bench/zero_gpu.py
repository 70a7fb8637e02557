"""Step time and memory of zerotrain's stages against plain PyTorch and DeepSpeed, on GPUs.

    python bench/zero_gpu.py                      # GPT 1.3B, bf16, micro-batch 8 x 1024
    python bench/zero_gpu.py --nproc 8            # the same on 8 GPUs (torchrun per case)
    python bench/zero_gpu.py --size tiny --device cpu --steps 3   # smoke test anywhere

Every case trains with one precision policy: bf16 parameters and activations, fp32 master
weights and fp32 Adam state, fp32 loss, AdamW at lr 1e-4. Plain PyTorch does this by hand
(an fp32 copy of the weights stepped by fused AdamW, cast back to bf16), so it is the same
arithmetic the ZeRO cases run, not autocast over fp32 weights. Cases: ``plain``,
``stage1``-``stage3``, ``z2_cpu`` (stage 2, optimizer on the host), ``z3_cpu_param``
(stage 3, optimizer and parameters on the host), and the same configs run by DeepSpeed
(``ds_stage1`` ...) when it is importable; a case that cannot run prints why. Each case
runs in its own process group (``--nproc`` processes, one GPU each; plain uses DDP above
one) and prints one JSON line; the table gives seconds per step, the ratio to plain measured
in the same run, and peak device memory of rank 0. ``--compile`` compiles every case
(plain: ``model.compile()``; the engines: ``engine.compile()``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_model import GPT, VOCAB  # noqa: E402  (bench/ is not a package)

SIZES = {"1.3b": dict(d_model=2048, n_layer=24, n_head=16),
         "tiny": dict(d_model=64, n_layer=2, n_head=2)}
ZERO = {"stage1": {"stage": 1}, "stage2": {"stage": 2}, "stage3": {"stage": 3},
        "z2_cpu": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "z3_cpu_param": {"stage": 3,
                         "offload_optimizer": {"device": "cpu", "pin_memory": True},
                         "offload_param": {"device": "cpu", "pin_memory": True}}}
CASES = ["plain"] + list(ZERO) + [f"ds_{name}" for name in ZERO]
LR = 1e-4


def _config(case: str, args) -> dict:
    zero = dict(ZERO[case.removeprefix("ds_")], overlap_comm=True,
                reduce_bucket_size=50_000_000, allgather_bucket_size=50_000_000)
    return {"train_micro_batch_size_per_gpu": args.batch, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "steps_per_print": 10 ** 9, "zero_optimization": zero}


def _plain(model: torch.nn.Module, device: torch.device, world: int):
    """bf16 weights, fp32 masters stepped by AdamW, cast back: zerotrain's policy by hand."""
    model = model.to(torch.bfloat16)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.0, fused=device.type == "cuda")

    def step(idx):
        model(idx, idx).backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        for p, m in zip(params, masters):
            p.data.copy_(m)
    return step


def run_case(case: str, args) -> dict:
    """One case in this process (a rank of its own group); returns rank 0's figures."""
    import torch.distributed as dist
    device = torch.device(args.device)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = GPT(**SIZES[args.size], seq=args.seq).to(device)
    idx = torch.randint(0, VOCAB, (args.batch, args.seq), device=device)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if case == "plain":
        if args.compile:
            model.compile()
        if world > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        step = _plain(model, device, world)
    else:
        if case.startswith("ds_"):
            import deepspeed as lib
        else:
            import zerotrain as lib
        engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(),
                                    config=_config(case, args))
        if args.compile:
            engine.compile()

        def step(idx):
            engine.backward(engine(idx, idx))
            engine.step()
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(idx)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    steady = sorted(times[2:] or times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"case": case, "world": world, "s_per_step": steady[len(steady) // 2],
            "peak_gib": peak}


def _launch(case: str, args) -> dict:
    if case.startswith("ds_"):
        try:
            import deepspeed  # noqa: F401
        except Exception as exc:   # not installed, or its import fails on this machine
            return {"case": case, "skipped": f"DeepSpeed not importable ({type(exc).__name__})"}
    own = [a for a in sys.argv[1:] if not a.startswith("--nproc")]
    script = [os.path.abspath(__file__), "--case", case] + own
    if args.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}"] + script
        env = dict(os.environ)
    else:
        cmd = [sys.executable] + script
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"case": case, "error": (out.stderr or out.stdout)[-500:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per case")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--compile", action="store_true", help="torch.compile every case")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        row = run_case(args.case, args)
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps(row), flush=True)
        return 0
    rows = []
    for case in args.cases.split(","):
        rows.append(_launch(case, args))
        print(json.dumps(rows[-1]), flush=True)
    _table(rows, args)
    return 0


def _table(rows: list[dict], args) -> None:
    base = next((r["s_per_step"] for r in rows if r["case"] == "plain" and "s_per_step" in r),
                None)
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\n{args.nproc} x {where}, torch {torch.__version__}, GPT {args.size}, micro-batch "
          f"{args.batch} x {args.seq} per rank, bf16 parameters, fp32 masters and Adam"
          + (", compiled" if args.compile else ""))
    print("| case | s/step | ratio to plain | peak GiB |\n|---|---|---|---|")
    for r in rows:
        if "s_per_step" not in r:
            why = r.get("skipped") or (r.get("error") or "?").strip().splitlines()[-1:]
            print(f"| {r['case']} | {why if isinstance(why, str) else ''.join(why)} | | |")
            continue
        ratio = r["s_per_step"] / base if base else float("nan")
        print(f"| {r['case']} | {r['s_per_step']:.3f} | {ratio:.2f} | {r['peak_gib']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
