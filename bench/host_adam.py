"""The host optimizer step offload relies on: torch's fused CPU AdamW against its other modes.

    python bench/host_adam.py                    # 64M fp32 parameters, all cores
    python bench/host_adam.py --numel 268435456  # the size quoted for DeepSpeed's CPU Adam

Steps one flat fp32 tensor (as offload does: one record per bucket) with ``fused=True``,
``foreach=True`` and the single-tensor loop, and prints milliseconds per step (median of
``--steps`` after two warm-up steps), parameters per second, and each mode's time as a
multiple of the fused one, all measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

MODES = {"fused": {"fused": True}, "foreach": {"foreach": True},
         "single-tensor": {"foreach": False}}


def time_mode(numel: int, kwargs: dict, steps: int) -> float:
    param = torch.zeros(numel)
    param.grad = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **kwargs)
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    print("command: python " + " ".join(sys.argv))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.numel / 1e6:.1f}M fp32 parameters")
    results = {name: time_mode(args.numel, kwargs, args.steps) for name, kwargs in MODES.items()}
    fused = results["fused"]
    print("\n| mode | ms/step | parameters/s | time vs fused |\n|---|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {args.numel / seconds / 1e9:.2f}G | "
              f"{seconds / fused:.2f}x |")


if __name__ == "__main__":
    main()
