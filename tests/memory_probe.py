"""Live tensor bytes an engine holds, measured where a step's state is largest.

Shared by the memory tests of each precision: the figure is taken after the second
backward (gradients and optimizer state both exist, the loss freed) and before its step,
above a ``baseline`` taken before the model was built, without the input batch.
"""
from __future__ import annotations

import gc
from typing import Any

import torch


def held_tensors() -> list[torch.Tensor]:
    """Every tensor alive now: holding them keeps anything older from being freed during a
    measurement (a pool process ran other tests), so a difference is the engine's alone."""
    gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def measure_two_steps(engine: Any, x: torch.Tensor, baseline: int) -> tuple[int, dict]:
    """Two training steps on ``x``; the live bytes above ``baseline`` after the second
    backward, and ``engine.memory_breakdown()`` at that moment."""
    from zerotrain.core.memory import live_tensor_bytes
    measured, breakdown = 0, {}
    for step in range(2):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        if step == 1:
            del loss
            gc.collect()
            measured = live_tensor_bytes() - baseline - x.untyped_storage().nbytes()
            breakdown = engine.memory_breakdown()
        engine.step()
    return measured, breakdown
