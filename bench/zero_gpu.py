"""One-GPU step time and memory of zerotrain's stages against plain PyTorch.

    python bench/zero_gpu.py                      # GPT 1.3B, bf16, micro-batch 8 x 1024
    python bench/zero_gpu.py --size tiny --device cpu --steps 3   # smoke test anywhere

Each case runs in its own process (world size 1, so this measures the hooks, gathers and
copies of each stage rather than communication) and prints one JSON line; the table at the
end gives seconds per step, the ratio to plain PyTorch measured in the same run, and peak
device memory. Cases: plain (autocast bf16 + fused AdamW), zerotrain stage 2, stage 3.
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


def run_case(case: str, args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = GPT(**SIZES[args.size], seq=args.seq).to(device)
    idx = torch.randint(0, VOCAB, (args.batch, args.seq), device=device)
    if case == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        import zerotrain
        stage = int(case[-1])
        config = {"train_micro_batch_size_per_gpu": args.batch, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                  "steps_per_print": 10 ** 9,
                  "zero_optimization": {"stage": stage, "overlap_comm": True}}
        engine, *_ = zerotrain.initialize(model=model, config=config)

        def step():
            engine.backward(engine(idx, idx))
            engine.step()
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    steady = sorted(times[2:] or times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"case": case, "s_per_step": steady[len(steady) // 2], "peak_gib": peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cases", default="plain,stage2,stage3")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args)), flush=True)
        return 0
    rows = []
    for case in args.cases.split(","):
        cmd = [sys.executable, __file__, "--case", case] + sys.argv[1:]
        env = dict(os.environ, MASTER_ADDR="", WORLD_SIZE="1")
        env.pop("MASTER_ADDR")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else None
        rows.append(json.loads(line) if line else {"case": case, "error": out.stderr[-500:]})
        print(json.dumps(rows[-1]), flush=True)
    base = next((r["s_per_step"] for r in rows if r.get("case") == "plain"
                 and "s_per_step" in r), None)
    print(f"\n{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}, "
          f"torch {torch.__version__}, GPT {args.size}, micro-batch {args.batch} x {args.seq}")
    print("| case | s/step | ratio to plain | peak GiB |\n|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | error: {r['error'].splitlines()[-1] if r['error'] else '?'} | | |")
            continue
        ratio = r["s_per_step"] / base if base else float("nan")
        print(f"| {r['case']} | {r['s_per_step']:.3f} | {ratio:.2f} | {r['peak_gib']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
