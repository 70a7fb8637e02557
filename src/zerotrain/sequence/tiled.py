"""Tiled compute along the sequence: DeepSpeed's ALST ``sequence_tiled_compute``,
``SequenceTiledCompute``, ``TiledMLP`` and ``TiledFusedLogitsLoss`` (0.19.8 signatures).

At a long sequence the MLP's intermediate activations (``seq x intermediate``) and the
logits (``seq x vocab``) are the largest tensors of a step. These autograd functions run
the computation one sequence tile at a time under ``no_grad`` and recompute each tile in
backward, so only one tile's intermediates are alive at once, and full logits never
exist (``TiledFusedLogitsLoss``: Note "backward recomputes each tile" there, where it
departs from DeepSpeed).

Note: gradients of the weights inside a tile
    Each tile's backward adds into the weights' ``.grad``. A stage would reduce (and
    clear) a gradient each time one lands, so, as in DeepSpeed, every weight of
    ``compute_params`` carries ``ds_grad_is_ready = False`` until the last tile: the
    stages (``stages/zero12.py``, ``stages/zero3/stage.py``) leave a gradient that is not
    ready where it is, so the tiles sum in ``.grad`` and the sum is reduced once.

Note: stage 3
    The weights are gathered by the module hooks as the tiles call their modules; a
    tiled call's units stay gathered across its tiles, so a step's all-gathers are no
    more than the untiled step's (tests/dist/test_sequence_tiled_zero.py counts them).
    ``compute_params`` must name every trained weight the function uses (a weight left
    out would be handed to the stage after its first tile).

Bad inputs (a shard count below 1, a sequence shorter than the shard count, an unknown
reduction, mismatched shapes) raise :class:`~zerotrain.errors.TilingError` naming them.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..errors import TilingError

__all__ = ["AutogradComputeMLP", "SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP",
           "sequence_tiled_compute"]

REDUCTIONS = (None, "mean", "sum")


# --------------------------------------------------------------------------- checks
def check_shards(where: str, shards: Any, seqlen: int) -> int:
    """``shards`` as an int in ``[1, seqlen]``, or a one-line error naming ``where``."""
    if isinstance(shards, bool) or not isinstance(shards, int):
        raise TilingError(f"{where}: shards must be an int, got {type(shards).__name__} "
                          f"{shards!r}")
    if shards < 1:
        raise TilingError(f"{where}: shards={shards} must be at least 1")
    if seqlen < shards:
        raise TilingError(f"{where}: the sequence ({seqlen}) is shorter than shards={shards}; "
                          f"use at most {max(seqlen, 1)} shards")
    return shards


def trained(compute_params: Optional[Iterable[torch.Tensor]]) -> list[torch.Tensor]:
    """The weights of ``compute_params`` that get gradients (DeepSpeed filters the same)."""
    return [p for p in (compute_params or []) if p.requires_grad]


def mark_ready(params: Sequence[torch.Tensor], tile: int, tiles: int) -> None:
    """Note: gradients of the weights inside a tile: ready on the last tile only."""
    for param in params:
        param.ds_grad_is_ready = tile + 1 == tiles


# --------------------------------------------------------------------------- generic
def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int,
                           kwargs_to_shard: dict[str, torch.Tensor],
                           kwargs_to_pass: dict[str, Any], grad_requiring_tensor_key: str,
                           compute_params: Optional[Sequence[torch.Tensor]] = None,
                           output_unshard_dimension: int = 1,
                           output_reduction: Optional[str] = "mean") -> torch.Tensor:
    """``fn(**kwargs_to_shard tiled on dim 1, **kwargs_to_pass)`` in ``shards`` tiles.

    The outputs are joined on ``output_unshard_dimension`` (0: each tile returns a scalar,
    as a loss does) and reduced by ``output_reduction`` (None, "mean", "sum"). Only
    ``kwargs_to_shard[grad_requiring_tensor_key]`` gets a gradient; ``compute_params`` are
    the weights ``fn`` uses (Note: gradients of the weights inside a tile).
    """
    if output_reduction not in REDUCTIONS:
        raise TilingError(f"sequence_tiled_compute: output_reduction={output_reduction!r}; "
                          f"valid values: None, 'mean', 'sum'")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise TilingError(f"sequence_tiled_compute: grad_requiring_tensor_key="
                          f"{grad_requiring_tensor_key!r} is not a key of kwargs_to_shard "
                          f"({sorted(kwargs_to_shard)})")
    for key, value in kwargs_to_shard.items():
        if not torch.is_tensor(value) or value.dim() < 2 or value.shape[1] != seqlen:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise TilingError(f"sequence_tiled_compute: kwargs_to_shard[{key!r}] must be a "
                              f"tensor [batch, seqlen={seqlen}, ...], got {shape}")
    check_shards("sequence_tiled_compute", shards, seqlen)
    return SequenceTiledCompute.apply(
        fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
        grad_requiring_tensor_key, compute_params, output_unshard_dimension,
        output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind :func:`sequence_tiled_compute` (its arguments are
    positional: an autograd function takes no dicts). ``fn`` runs twice per step: once
    per tile in forward (no graph kept) and again in backward."""

    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass,
                grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                output_reduction, *args) -> torch.Tensor:
        check_shards("SequenceTiledCompute", shards, seqlen)
        ctx.fn, ctx.seqlen, ctx.shards = fn, seqlen, shards
        ctx.grad_requiring_tensor_key = grad_requiring_tensor_key
        ctx.compute_params = trained(compute_params)
        ctx.output_unshard_dimension = output_unshard_dimension
        ctx.output_reduction = output_reduction
        ctx.total_args = len(args)
        ctx.grad_requiring_tensor_key_index = (list(keys_to_shard) + list(keys_to_pass)).index(
            grad_requiring_tensor_key)
        ctx.kwargs_to_shard = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        ctx.kwargs_to_pass = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        step = ctx.shard_step = math.ceil(seqlen / shards)
        with torch.no_grad():
            outputs = [fn(**{k: v[:, i * step:(i + 1) * step]
                             for k, v in ctx.kwargs_to_shard.items()}, **ctx.kwargs_to_pass)
                       for i in range(shards)]
            if output_unshard_dimension == 0:   # one scalar per tile (a loss)
                joined = torch.cat([out.unsqueeze(0) for out in outputs], dim=0)
            else:
                joined = torch.cat(outputs, dim=output_unshard_dimension)
            ctx.joined_numel = joined.numel()
            if output_reduction == "mean":
                return joined.mean()
            if output_reduction == "sum":
                return joined.sum()
            return joined

    @staticmethod
    def backward(ctx, *grads):
        source = ctx.kwargs_to_shard[ctx.grad_requiring_tensor_key]
        wants_grad = source.requires_grad
        source = source.detach().requires_grad_(wants_grad)
        incoming = grads[0]
        if ctx.output_reduction == "mean":   # the mean over the joined output is outside the graph
            incoming = incoming / ctx.joined_numel
        source_grad = torch.zeros_like(source)
        for i in range(ctx.shards):
            mark_ready(ctx.compute_params, i, ctx.shards)
            offset = min(i * ctx.shard_step, ctx.seqlen)
            tile = {k: (source if k == ctx.grad_requiring_tensor_key else v)[
                :, offset:offset + ctx.shard_step] for k, v in ctx.kwargs_to_shard.items()}
            piece = tile[ctx.grad_requiring_tensor_key]
            width = piece.shape[1]
            if width == 0:   # a ceil-sized step can leave the last tiles empty
                continue
            with torch.enable_grad():
                leaf = piece.detach().requires_grad_(wants_grad)
                tile[ctx.grad_requiring_tensor_key] = leaf
                output = ctx.fn(**tile, **ctx.kwargs_to_pass)
            if ctx.output_unshard_dimension == 0:   # one scalar per tile
                torch.autograd.backward(output, incoming)
            elif ctx.output_reduction is not None:   # every element got the same gradient
                torch.autograd.backward(output, incoming.expand_as(output))
            else:
                torch.autograd.backward(
                    output, incoming.narrow(ctx.output_unshard_dimension, offset, width))
            if wants_grad and leaf.grad is not None:
                source_grad.narrow(1, offset, width).copy_(leaf.grad)
        mark_ready(ctx.compute_params, 0, 1)
        args_grads: list[Optional[torch.Tensor]] = [None] * ctx.total_args
        args_grads[ctx.grad_requiring_tensor_key_index] = source_grad if wants_grad else None
        return (None,) * 9 + tuple(args_grads)


# --------------------------------------------------------------------------- MLP
class TiledMLP(torch.autograd.Function):
    """``fn(self, x)`` (an MLP) in ``shards`` tiles along ``x``'s second-to-last dimension
    (``[batch, seq, hidden]`` or ``[seq, hidden]``); recomputed per tile in backward.

    ``TiledMLP.apply(fn, self, x, shards, compute_params)``, as in DeepSpeed, e.g. for a
    Llama MLP: ``fn = lambda self, x: self.down_proj(self.act_fn(self.gate_proj(x)) *
    self.up_proj(x))`` with ``compute_params = [m.down_proj.weight, m.gate_proj.weight,
    m.up_proj.weight]``. Only ``x`` gets a gradient back; the weights get theirs through
    ``fn``'s own graph, once per step (Note: gradients of the weights inside a tile).
    """

    @staticmethod
    def forward(ctx, fn, self, x, shards, compute_params) -> torch.Tensor:
        if not torch.is_tensor(x) or x.dim() < 2:
            raise TilingError(f"TiledMLP: x must be [batch, seq, hidden] or [seq, hidden], "
                              f"got {tuple(x.shape) if torch.is_tensor(x) else type(x).__name__}")
        check_shards("TiledMLP", shards, x.shape[-2])
        ctx.fn, ctx.self, ctx.shards = fn, self, shards
        ctx.compute_params = trained(compute_params)
        ctx.save_for_backward(x)
        with torch.no_grad():
            outputs = [fn(self, piece) for piece in torch.chunk(x, chunks=shards, dim=-2)]
        return torch.cat(outputs, dim=-2)

    @staticmethod
    def backward(ctx, *grads):
        (x,) = ctx.saved_tensors
        wants_grad = x.requires_grad
        hidden = x.shape[-1]
        # rows of batch x seq flattened: a tile is one contiguous block of rows
        flat = x.detach().reshape(-1, hidden)
        incoming = grads[0].reshape(-1, hidden)
        x_grad = torch.zeros_like(flat)
        pieces = torch.chunk(flat, chunks=ctx.shards, dim=0)
        offset = 0
        for i, piece in enumerate(pieces):
            mark_ready(ctx.compute_params, i, len(pieces))
            rows = piece.shape[0]
            leaf = piece.detach().requires_grad_(wants_grad)
            with torch.enable_grad():
                output = ctx.fn(ctx.self, leaf)
            torch.autograd.backward(output, incoming.narrow(0, offset, rows))
            if wants_grad and leaf.grad is not None:
                x_grad.narrow(0, offset, rows).copy_(leaf.grad)
            offset += rows
        mark_ready(ctx.compute_params, 0, 1)
        return None, None, (x_grad.view(x.shape) if wants_grad else None), None, None


class AutogradComputeMLP(torch.autograd.Function):
    """``fn(self, x)`` untiled, its graph not kept: recomputed in backward (DeepSpeed's
    one-tile example of :class:`TiledMLP`; ``AutogradComputeMLP.apply(fn, self, x)``)."""

    @staticmethod
    def forward(ctx, fn, self, x) -> torch.Tensor:
        ctx.fn, ctx.self = fn, self
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(self, x)

    @staticmethod
    def backward(ctx, *grads):
        (x,) = ctx.saved_tensors
        leaf = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            output = ctx.fn(ctx.self, leaf)
        torch.autograd.backward(output, grads[0])
        return None, None, leaf.grad


# --------------------------------------------------------------------------- logits + loss
class TiledFusedLogitsLoss(torch.autograd.Function):
    """``fn(self, x_tile, y_tile[, mask_tile])`` -> a scalar loss per tile, reduced by
    "mean" (over tiles) or "sum"; the full logits never exist.

    ``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)``, as in DeepSpeed: ``x`` ``[batch, seq, hidden]``, ``y``
    ``[batch, seq, ...]``, ``mask`` None or ``[batch, seq]``; the tiles are blocks of
    the flattened ``batch x seq`` rows. "mean" is a mean of the tiles' losses: with
    unequal tiles or masks pass "sum" and divide by the count yourself, as DeepSpeed
    advises.

    Note: backward recomputes each tile
        DeepSpeed runs each tile's backward inside forward with an assumed incoming
        gradient of 1 and later scales only ``x``'s gradient, so the weights' gradients
        ignore whatever multiplies the loss afterwards: the engine's 1/accumulation-steps,
        fp16's loss scale, a division by the token count. Here forward keeps only ``x``
        (the size of the gradient DeepSpeed keeps) and each tile's logits are recomputed
        in backward with the true incoming gradient, so every gradient equals the untiled
        one; the cost is one more ``fn`` per tile.
    """

    @staticmethod
    def forward(ctx, fn, self, x, y, mask, shards, compute_params,
                output_reduction) -> torch.Tensor:
        _check_loss_inputs(x, y, mask, output_reduction)
        bs, seqlen = x.shape[:2]
        check_shards("TiledFusedLogitsLoss", shards, bs * seqlen)
        ctx.fn, ctx.self, ctx.shards = fn, self, shards
        ctx.compute_params = trained(compute_params)
        ctx.output_reduction = output_reduction
        ctx.has_mask = mask is not None
        ctx.save_for_backward(x, y, *([mask] if mask is not None else []))
        with torch.no_grad():
            losses = [fn(*tile) for tile in _loss_tiles(self, x, y, mask, shards)]
            joined = torch.stack([loss.reshape(()) for loss in losses])
            return joined.mean() if output_reduction == "mean" else joined.sum()

    @staticmethod
    def backward(ctx, *grads):
        x, y, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.has_mask else None
        wants_grad = x.requires_grad
        incoming = grads[0] / ctx.shards if ctx.output_reduction == "mean" else grads[0]
        tiles = _loss_tiles(ctx.self, x.detach(), y, mask, ctx.shards)
        x_grad = torch.zeros_like(x).reshape(-1, *x.shape[2:])
        offset = 0
        for i, (module, piece, *labels) in enumerate(tiles):
            mark_ready(ctx.compute_params, i, len(tiles))
            rows = piece.shape[0]
            leaf = piece.detach().requires_grad_(wants_grad)
            with torch.enable_grad():
                loss = ctx.fn(module, leaf, *labels)
            torch.autograd.backward(loss, incoming.to(loss.dtype).reshape(loss.shape))
            if wants_grad and leaf.grad is not None:
                x_grad.narrow(0, offset, rows).copy_(leaf.grad)
            offset += rows
        mark_ready(ctx.compute_params, 0, 1)
        return (None, None, x_grad.view(x.shape) if wants_grad else None,
                None, None, None, None, None)


def _loss_tiles(module: Any, x: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor],
                shards: int) -> list[tuple]:
    """``(module, x rows, y rows[, mask rows])`` per tile of the flattened batch x seq."""
    xs = torch.chunk(x.reshape(-1, *x.shape[2:]), chunks=shards, dim=0)
    ys = torch.chunk(y.reshape(-1, *y.shape[2:]), chunks=shards, dim=0)
    if mask is None:
        return [(module, xp, yp) for xp, yp in zip(xs, ys)]
    ms = torch.chunk(mask.reshape(-1), chunks=shards, dim=0)
    return [(module, xp, yp, mp) for xp, yp, mp in zip(xs, ys, ms)]


def _check_loss_inputs(x: Any, y: Any, mask: Any, output_reduction: Any) -> None:
    """DeepSpeed's checks on ``TiledFusedLogitsLoss``'s inputs, as one-line errors."""
    if output_reduction not in ("mean", "sum"):
        raise TilingError(f"TiledFusedLogitsLoss: output_reduction={output_reduction!r}; "
                          f"valid values: 'mean', 'sum'")
    for name, value in (("x", x), ("y", y)):
        if not torch.is_tensor(value) or value.dim() < 2:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise TilingError(f"TiledFusedLogitsLoss: {name} must be at least 2-D "
                              f"[batch, seq, ...], got {shape}")
    if x.shape[:2] != y.shape[:2]:
        raise TilingError(f"TiledFusedLogitsLoss: x {tuple(x.shape)} and y {tuple(y.shape)} "
                          f"differ in [batch, seq]")
    if mask is not None and (not torch.is_tensor(mask) or mask.shape != x.shape[:2]):
        shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        raise TilingError(f"TiledFusedLogitsLoss: mask must be [batch, seq] = "
                          f"{tuple(x.shape[:2])}, got {shape}")
