"""Start many 2-rank gloo jobs that train and then exit normally; count the exits that abort.

    python tests/exit_runs.py OUT.json [--runs 100] [--deadline 60] [--no-teardown]
                              [--end-in-backward]

Each run forks two ranks from this already-imported process (so a run costs the gloo
rendezvous, two training steps and the exit, not two interpreter start-ups). A rank trains
through ``zerotrain.initialize``, which adopts the group and registers the exit teardown,
then leaves by ``sys.exit(0)``: a real interpreter finalization, where gloo's exit abort
(``terminate called without an active exception``, SIGABRT) happens. ``--no-teardown``
unregisters the teardown, to measure what it prevents. Stops after ``--runs`` runs or once
``--deadline`` seconds have passed; writes counts and the teardown's duration per rank (ms).
"""
import argparse
import atexit
import json
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401 - see below
import torch.distributed as dist  # noqa: E402

import reference as R  # noqa: E402
import zerotrain  # noqa: E402
from zerotrain.comm import teardown  # noqa: E402

# torch.optim.Optimizer imports torch._dynamo on first use (about 800 modules, 2-3 s of CPU);
# imported here once, a forked rank does not pay it again in every run, and still exits
# with the same modules loaded as when it imported them itself.


def _rank(rank: int, store_path: str, cost_path: str, use_teardown: bool,
          end_in_backward: bool) -> None:
    """One rank of one run: train two steps at stage 2 (and with ``end_in_backward`` a last
    backward, whose reduction is issued from autograd), then return to exit normally."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=R.engine_config(stage=2))
    atexit.unregister(teardown.at_exit)
    if use_teardown:
        atexit.register(_timed_teardown, cost_path)
    for step in range(2):
        engine.backward(engine(*R.micro_batch(step, rank, 0)))
        engine.step()
    if end_in_backward:
        engine.backward(engine(*R.micro_batch(2, rank, 0)))


def _timed_teardown(cost_path: str) -> None:
    start = time.perf_counter()
    teardown.at_exit()
    with open(cost_path, "w") as f:
        f.write(str((time.perf_counter() - start) * 1e3))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--deadline", type=float, default=60.0)
    parser.add_argument("--no-teardown", action="store_true")
    parser.add_argument("--end-in-backward", action="store_true")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="zt-exit-")
    aborted, failed, costs, runs = 0, 0, [], 0
    start = time.monotonic()
    while runs < args.runs and time.monotonic() - start < args.deadline:
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                _rank(rank, f"{work}/store{runs}", f"{work}/cost{runs}-{rank}",
                      not args.no_teardown, args.end_in_backward)
                sys.exit(0)   # a normal exit: atexit handlers, then interpreter finalization
            pids.append(pid)
        for rank, pid in enumerate(pids):
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT:
                aborted += 1
            elif not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
                failed += 1
            cost = f"{work}/cost{runs}-{rank}"
            if os.path.exists(cost):
                with open(cost) as f:
                    costs.append(float(f.read()))
        runs += 1
    with open(args.out, "w") as f:
        json.dump({"runs": runs, "processes": 2 * runs, "aborted": aborted, "failed": failed,
                   "seconds": time.monotonic() - start, "teardown_ms": sorted(costs)}, f)


if __name__ == "__main__":
    main()
