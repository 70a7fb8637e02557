"""Newton-Schulz orthogonalisation of whole matrices, as DeepSpeed 0.19.8 and torch compute it.

Why a module of its own: the arithmetic must match the two optimizers zerotrain stands in
for (DeepSpeed's ``MuonWithAuxAdam`` from its ``"optimizer": {"type": "Muon"}``, and a client
``torch.optim.Muon``) to rounding, and it is the one part of Muon that needs a whole matrix;
``sharded.py`` brings the matrix together and calls one of :func:`deepspeed_orthogonalize`
or :func:`torch_orthogonalize`. Nothing here communicates.

Note: the compute dtype
    DeepSpeed runs its default ``gram`` iteration in fp16 where the accelerator supports
    fp16 (CUDA; on the CPU only where oneDNN has fp16), else fp32, and its ``standard``
    iteration in bf16 (every accelerator it knows supports bf16). :func:`ns_compute_dtype`
    asks the same questions of the device the matrix is on. torch's Muon always runs in bf16.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

NS_METHODS = ("gram", "standard")
_A, _B, _C = 3.4445, -4.7750, 2.0315


def ns_compute_dtype(ns_method: str, device: torch.device) -> torch.dtype:
    """DeepSpeed's ``ns_compute_dtype`` for a matrix on ``device`` (Note: the compute dtype)."""
    if ns_method == "gram":
        return torch.float16 if _fp16_supported(device) else torch.float32
    return torch.bfloat16


def _fp16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    try:   # DeepSpeed's CPU accelerator asks oneDNN
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


def standard_newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The quintic iteration (DeepSpeed's ``zeropower_via_newtonschulz5``)."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        a = x @ x.mT
        b = _B * a + _C * a @ a
        x = _A * x + b @ x
    return x.mT if tall else x


def gram_newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The Gram iteration on ``X @ X.T`` with a restart at step 2 (DeepSpeed's
    ``zeropower_via_gram_newtonschulz``); square matrices take the quintic one."""
    norm_dtype = torch.float32 if g.dtype == torch.float16 else g.dtype
    x = g.to(norm_dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    n, m = x.size(-2), x.size(-1)
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    if m <= n:
        for _ in range(steps):
            a = x @ x.mT
            b = _B * a + _C * a @ a
            x = _A * x + b @ x
        return x.mT if tall else x
    r = x @ x.mT
    q: Optional[torch.Tensor] = None
    restart_at = 2
    for i in range(steps):
        if i == restart_at:
            x = q @ x
            r = x @ x.mT
            q = None
        z = _B * r + _C * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(_A)
        else:
            q = _A * q + z @ q
        if i < steps - 1 and (i + 1) != restart_at:
            rz = _A * r + z @ r
            r = _A * rz + z @ rz
    return x.mT @ q.mT if tall else q @ x


def aspect_scale(rows: int, cols: int) -> float:
    """DeepSpeed's ``sqrt(max(1, rows / cols))``."""
    return math.sqrt(rows / cols) if rows > cols else 1.0


def deepspeed_orthogonalize(update: torch.Tensor, *, ns_method: str = "gram", steps: int = 5,
                            num_heads: Optional[int] = None,
                            batched: bool = False) -> torch.Tensor:
    """DeepSpeed's ``muon_update`` after its momentum: ``update`` is the whole matrix (its
    parameter's shape), the result has that shape and dtype."""
    if ns_method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {', '.join(NS_METHODS)}, got {ns_method!r}")
    shape, dtype = update.shape, update.dtype
    ns = gram_newton_schulz if ns_method == "gram" else standard_newton_schulz
    compute = ns_compute_dtype(ns_method, update.device)
    if num_heads is not None:
        out_features, in_features = shape
        if num_heads < 1 or out_features % num_heads:
            raise ValueError(f"per-head Muon needs the output dim {out_features} to split "
                             f"evenly across num_heads={num_heads}")
        head = out_features // num_heads
        out = ns(update.view(num_heads, head, in_features), steps, compute)
        return (out * aspect_scale(head, in_features)).reshape(shape).to(dtype)
    if batched:
        out = ns(update, steps, compute) * aspect_scale(update.size(-2), update.size(-1))
        return out.to(dtype)
    matrix = update.view(len(update), -1) if update.ndim == 4 else update
    out = ns(matrix, steps, compute)
    out = out * aspect_scale(shape[-2], shape[-1])
    return out.to(dtype).reshape(shape)


def torch_orthogonalize(update: torch.Tensor, group: dict) -> torch.Tensor:
    """``torch.optim.Muon``'s Newton-Schulz for one whole 2-D matrix, with its group's
    coefficients, steps and eps (torch's own function, so the arithmetic is torch's)."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    return _zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"],
                                       group["eps"])


def torch_adjusted_lr(group: dict, shape: torch.Size) -> float:
    """``torch.optim.Muon``'s learning rate for a matrix of ``shape``."""
    from torch.optim._muon import _adjust_lr
    return _adjust_lr(group["lr"], group["adjust_lr_fn"], shape)
