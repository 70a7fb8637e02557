"""The predicted peak of a step of a running engine (``engine.memory_breakdown()``'s
peak_predicted), traced in a process of its own.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch

from .fake_world import _FakeTracker, fake_world
from .spec import PlanError
from .trace import STEPS



def predict_engine_peak(engine: Any, build: Callable[[], torch.nn.Module],
                        batch: tuple, config: dict) -> int:
    """The predicted peak of a step of ``engine`` on this rank, for the model ``build()``
    makes, trained with the DeepSpeed ``config`` on micro-batches shaped like ``batch``
    (the forward's positional tensors; the output, or its ``.loss``, is the loss). Noted on
    the engine (``note_predicted_peak``): ``engine.memory_breakdown()`` reports it as
    peak_predicted, beside the peak_measured of ``engine.measure_peak()``.

    Why a process of its own: the trace runs rank 0 of a fake world, and a process that
    trains already has a process group; a spawned process (fresh interpreter, no group)
    traces :data:`STEPS` steps of a model built on fake tensors, so nothing is allocated and
    the training state is left alone. ``build`` must be picklable (a class, a
    ``functools.partial``). Every rank of a symmetric run gets the same figure; ranks call
    it alone, it runs no collective."""
    cached = engine.predicted_peak
    if cached is not None:
        return cached
    import pickle
    import subprocess
    import sys

    shapes = [(tuple(t.shape), t.dtype) for t in batch]
    backend = "gloo" if engine.device.type == "cpu" else "nccl"
    args = pickle.dumps((build, config, engine.world_size, shapes, backend))
    env = {k: v for k, v in os.environ.items()   # the trainer's world, not the traced one
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", _CHILD], input=args, env=env,
                          capture_output=True, check=False)
    if done.returncode != 0:
        raise PlanError("the step could not be traced on fake tensors: "
                        + done.stderr.decode(errors="replace").strip()[-2000:])
    predicted = int(done.stdout.decode().split()[-1])
    engine.note_predicted_peak(predicted)
    return predicted


# A plain subprocess, not multiprocessing: a rank may run in a daemonic process, which
# multiprocessing forbids to have children.
_CHILD = ("import pickle, sys; from zerotrain.planner.live import _trace_built; "
          "print(_trace_built(*pickle.load(sys.stdin.buffer)))")


def _on_fake_tensors(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (built on meta or real tensors) with fresh fake parameters and buffers of
    the same shapes, tied parameters kept tied (``Module.to_empty`` cannot swap them under
    the fake mode)."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                     p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    return model


def _trace_built(build: Callable[[], torch.nn.Module], config: dict, world: int,
                 shapes: list, backend: str) -> int:
    """In the spawned process of :func:`predict_engine_peak`: the traced peak."""
    from ..engine.build import initialize

    tracker = _FakeTracker()
    with fake_world(0, world, backend):
        with torch.device("meta"):
            model = build()
        model = _on_fake_tensors(model)
        batch = [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes]
        with tracker:
            tracker.add_existing(list(model.parameters()) + list(model.buffers()))
            tracker.phase = "initialize"
            engine, *_ = initialize(model=model, config=config)
            for _ in range(STEPS):
                tracker.phase = "forward"
                out = engine(*batch)
                loss = out.loss if hasattr(out, "loss") else out
                del out
                tracker.phase = "backward"
                engine.backward(loss)
                del loss
                tracker.phase = "step"
                engine.step()
        with contextlib.suppress(Exception):
            engine.destroy()
    return tracker.peak
