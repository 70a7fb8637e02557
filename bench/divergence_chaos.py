"""Long chaos run for ranks that take different paths (the suite runs a short one,
tests/dist/test_divergent_paths.py): random rank-dependent routing over 4 experts at
stages 0-3 (the expert block a leaf module at 3), compared with one process, then every
injected divergence, each of which must stop every rank with RankDivergenceError.

    PYTHONPATH=src python bench/divergence_chaos.py --steps 2000 --worlds 2 3
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "dist"))

import moe_models as M  # noqa: E402
import reference as R  # noqa: E402
import test_divergent_paths as T  # noqa: E402
from distributed import run_world  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    failures = 0
    for world in args.worlds:
        start = time.perf_counter()
        ref = M.reference(steps=args.steps, world=world, n_experts=4, random_routes=True)
        for rank, out in enumerate(run_world(T._chaos, world, args.steps, timeout=7200)):
            for stage, weights in out.items():
                diff = R.max_diff(weights, ref)
                failures += diff >= 1e-3
                print(f"world {world} rank {rank} stage {stage}: max diff {diff:.2e}")
        print(f"world {world}: {args.steps} steps x 4 stages in "
              f"{time.perf_counter() - start:.0f}s")
        for case in T.CASES:
            results = run_world(T._inject, world, *case,
                                bad_step=T.BAD_STEP.get(case[1], 1), timeout=600)
            caught = all(name == "RankDivergenceError" for _, name, _ in results)
            failures += not caught
            print(f"world {world} {case}: {'caught on every rank' if caught else results}")
        for kind in T.TRACED:   # at stage 3 once a trace exists, with a short comms_timeout
            results = run_world(T._inject, world, 3, kind, bad_step=1,
                                comms_timeout=T.SHORT_TIMEOUT_S, timeout=600)
            caught = all(name == "RankDivergenceError" and step == 1
                         for step, name, _ in results)
            failures += not caught
            print(f"world {world} (3, {kind!r}) after the trace: "
                  f"{'caught on every rank' if caught else results}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
