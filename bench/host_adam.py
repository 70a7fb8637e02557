"""The host optimizer step offload relies on: torch's fused CPU AdamW against its other modes.

    python bench/host_adam.py                    # 64M fp32 parameters, all cores
    python bench/host_adam.py --numel 268435456  # the size quoted for DeepSpeed's CPU Adam

Steps one flat fp32 tensor (as offload does: one record per bucket) with ``fused=True``,
``foreach=True`` and the single-tensor loop, and prints milliseconds per step (median of
``--steps`` after two warm-up steps), parameters per second, and each mode's time as a
multiple of the fused one, all measured in the same run.

A second table times the other passes an offloaded step could make over host memory, per
parameter, against the fused Adam step of the same size (docs/offload.md, "the step-time
model"): widening a bf16 gradient to fp32, casting an fp32 master to bf16, the copy aside
of a record's state that the speculative step makes (master and two moments), and a plain
fp32 copy (host copy GB/s, counting bytes read plus written).
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


def _median_seconds(run, steps: int) -> float:
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        run()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_passes(numel: int, steps: int) -> dict[str, tuple[float, int]]:
    """Seconds per pass and the host bytes it moves (read + written)."""
    wide = torch.randn(numel)
    narrow = wide.to(torch.bfloat16)
    state = [torch.randn(numel) for _ in range(3)]
    kept = [torch.empty(numel) for _ in range(3)]
    out_wide, out_narrow = torch.empty(numel), torch.empty(numel, dtype=torch.bfloat16)

    def keep():
        for k, s in zip(kept, state):
            k.copy_(s)

    return {
        "widen bf16 -> fp32 (gradient on the host)": (
            _median_seconds(lambda: out_wide.copy_(narrow), steps), 6 * numel),
        "cast fp32 -> bf16 (master into the upload slot)": (
            _median_seconds(lambda: out_narrow.copy_(wide), steps), 6 * numel),
        "keep master + 2 moments (speculation)": (_median_seconds(keep, steps), 24 * numel),
        "fp32 copy": (_median_seconds(lambda: out_wide.copy_(wide), steps), 8 * numel),
    }


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
    print("\n| host pass | ms | host GB/s (read + written) | time vs fused Adam |\n"
          "|---|---|---|---|")
    print(f"| fused AdamW step (28 bytes/parameter) | {fused * 1e3:.1f} | "
          f"{28 * args.numel / fused / 1e9:.1f} | 1.00x |")
    for name, (seconds, moved) in time_passes(args.numel, args.steps).items():
        print(f"| {name} | {seconds * 1e3:.1f} | {moved / seconds / 1e9:.1f} | "
              f"{seconds / fused:.2f}x |")


if __name__ == "__main__":
    main()
