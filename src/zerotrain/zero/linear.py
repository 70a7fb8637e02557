"""``deepspeed.runtime.zero.linear``: ``LinearFunctionForZeroStage3`` and
``zero3_linear_wrap``, DeepSpeed's linear as an ``autograd.Function``.

Why: model code written for DeepSpeed calls ``zero3_linear_wrap`` (or patches
``F.linear`` with it) to get a linear whose backward saves the weight *parameter*, not a
copy of its gathered value, so a ZeRO-3 weight released after forward is read again when
backward re-gathers it. zerotrain's stage 3 gathers and releases around ``F.linear``
itself, so this is the same maths, kept for code that names it. It runs under
``torch.func`` (``setup_context`` and a vmap rule) and replays forward's autocast state in
backward: a forward under autocast gets its backward matmuls in the same dtype, one outside
autocast stays in full precision even if backward runs inside an autocast region.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["LinearFunctionForZeroStage3", "zero3_linear_wrap"]


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """``input @ weight.T + bias``; backward reads the saved parameters."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 (DeepSpeed's name)
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if input.dim() == 2 and bias is not None:   # one op, so autocast casts bias too
            return torch.addmm(bias, input, weight.t())
        out = input.matmul(weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        input, weight, bias = (tuple(inputs) + (None,))[:3]  # noqa: A001
        ctx.save_for_backward(input, weight, bias)
        device_type = input.device.type
        ctx._fwd_used_autocast = torch.is_autocast_enabled(device_type)
        ctx._dtype = torch.get_autocast_dtype(device_type)
        ctx._device_type = device_type

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        input, weight, bias = ctx.saved_tensors  # noqa: A001
        with torch.amp.autocast(device_type=ctx._device_type, dtype=ctx._dtype,
                                enabled=ctx._fwd_used_autocast):
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight)
            if ctx.needs_input_grad[1]:
                if grad_output.dim() == 1:   # an unbatched input: an outer product
                    grad_weight = grad_output.unsqueeze(1) * input.unsqueeze(0)
                else:
                    grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                        input.reshape(-1, input.shape[-1]))
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = (grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
                             if grad_output.dim() > 1 else grad_output)
        # gradients in each input's dtype (autocast computes in its own)
        if grad_input is not None:
            grad_input = grad_input.to(input.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor,  # noqa: A002
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` through :class:`LinearFunctionForZeroStage3` (DeepSpeed's name)."""
    if bias is None:
        return LinearFunctionForZeroStage3.apply(input, weight)
    return LinearFunctionForZeroStage3.apply(input, weight, bias)
