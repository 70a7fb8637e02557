"""How many threads the host optimizer step uses, and stepping one record alone.

Note: host step threads
    torchrun sets ``OMP_NUM_THREADS=1`` when it starts more than one process per node, so
    torch's fused CPU Adam would run each rank's step on one core while the others idle.
    The host step therefore runs with the cores this process may use divided by the ranks
    on the node (``LOCAL_WORLD_SIZE``), unless the user chose: an ``OMP_NUM_THREADS`` that
    torchrun did not set (any value outside torchrun, or one other than 1 under it) is
    kept. The count applies only while the host steps (OpenMP's setting is per thread, so
    the delayed update's worker sets its own) and is restored afterwards, so forward and
    backward on the CPU keep the user's setting.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping, Optional

import torch


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_step_threads(environ: Mapping[str, str], cores: int) -> Optional[int]:
    """Threads for the host step (Note: host step threads); None keeps the user's setting."""
    omp = environ.get("OMP_NUM_THREADS")
    under_torchrun = "TORCHELASTIC_RUN_ID" in environ
    if omp is not None and (omp.strip() != "1" or not under_torchrun):
        return None
    local_world = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, cores // local_world)


@contextlib.contextmanager
def threads(count: Optional[int]) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads (None: unchanged), then restore."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_alone(optimizer: torch.optim.Optimizer, group_index: int,
               master: torch.Tensor) -> None:
    """``optimizer.step()`` over ``master`` only (its ``.grad`` set by the caller).

    ``optimizer.step()`` visits every parameter of every group, so stepping N records one at
    a time would cost N^2 visits. This steps a shallow view of the optimizer whose only group
    is ``master``'s, with ``master`` its only parameter: the same class, the same state dict
    and the same hyperparameters, so the arithmetic is the optimizer's own. Group entries the
    step writes are copied back (only those: a speculative step runs on a worker thread,
    and the caller may set a new learning rate meanwhile).

    The class's ``step`` is called, not the instance's: an LR scheduler replaces the
    instance's ``step`` with a wrapper that steps the optimizer it was built on (all of
    it), and marks that optimizer as stepped; the mark is set here instead, so the
    scheduler does not warn that it stepped first.
    """
    group = optimizer.param_groups[group_index]
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    alone = dict(group)
    alone["params"] = [master]
    before = dict(alone)
    view.param_groups = [alone]
    type(optimizer).step(view)
    optimizer._opt_called = True   # what the scheduler's wrapper would have recorded
    for key, value in alone.items():   # only what the step wrote: the caller's thread may
        if key != "params" and before.get(key) is not value:   # have changed others since
            group[key] = value
