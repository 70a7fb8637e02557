"""``loss.backward()`` then ``engine.step()``: a plain PyTorch backward through the engine's
outputs does what ``engine.backward(loss)`` does (DeepSpeed accepts it since 0.18).

Note: how
    ``engine.forward`` passes the module's output tensors through one identity autograd
    node (:class:`_Gate`). When a backward that ``engine.backward`` did not start reaches
    that node, the node runs the engine's prologue (the stage learns whether this
    backward ends the accumulation window), multiplies each output gradient by the factor
    the prologue returns (``loss_scale / gradient_accumulation_steps``: what
    ``engine.backward`` applies to the loss) and queues the epilogue (the stage's
    ``finish_backward``) to run when autograd finishes the whole backward. A loss the
    module computes itself (a Hugging Face model's ``outputs.loss``) is one of the outputs,
    so it is scaled once, at its own gate, never again through the logits it came from.
    Inside ``engine.backward`` the node passes gradients through unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["DirectBackward"]


class _Gate(torch.autograd.Function):
    """Identity forward; backward hands the gradients to ``owner`` (Note: how)."""

    @staticmethod
    def forward(ctx, owner: "DirectBackward", *tensors: torch.Tensor):
        ctx.owner = owner
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *ctx.owner.on_gradients(grads))


class DirectBackward:
    """Routes backwards that do not come through ``engine.backward`` to the engine's
    prologue and epilogue (Note: how)."""

    def __init__(self, prologue: Callable[[], float], epilogue: Callable[[], None]) -> None:
        self._prologue, self._epilogue = prologue, epilogue
        self._managed = 0
        self._running = False
        self._factor = 1.0

    @contextlib.contextmanager
    def managed(self) -> Iterator[None]:
        """``engine.backward`` is running: gradients pass the gates unchanged."""
        self._managed += 1
        try:
            yield
        finally:
            self._managed -= 1

    def gate(self, outputs: Any) -> Any:
        """``outputs`` with every floating tensor that needs a gradient behind one gate."""
        found: list[torch.Tensor] = []
        _visit(outputs, found.append)
        if not found:
            return outputs
        gated = iter(_Gate.apply(self, *found))
        return _rebuild(outputs, lambda _: next(gated))

    def on_gradients(self, grads: tuple) -> tuple:
        if self._managed:
            return grads
        if not self._running:
            self._running = True
            self._factor = self._prologue()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return tuple(None if g is None else g * self._factor for g in grads)

    def _finish(self) -> None:
        self._running = False
        self._epilogue()


def _wanted(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.requires_grad
            and value.is_floating_point())


def _visit(value: Any, found: Callable[[torch.Tensor], None]) -> None:
    if _wanted(value):
        found(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _visit(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _visit(item, found)


def _rebuild(value: Any, swap: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with each wanted tensor replaced, in :func:`_visit`'s order; dicts (and
    Hugging Face ``ModelOutput``s) are updated in place, sequences rebuilt."""
    if _wanted(value):
        return swap(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):   # a namedtuple
        return type(value)(*(_rebuild(v, swap) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, swap) for v in value)
    if isinstance(value, dict):
        for key in list(value.keys()):
            value[key] = _rebuild(value[key], swap)
    return value
