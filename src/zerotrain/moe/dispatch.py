"""DeepSpeed's ``MOELayer``: tokens to expert slots, the experts, and back.

Note: dispatch by slot index
    A :class:`~zerotrain.moe.gate.Routing` gives every route (k per token) an expert ``e``
    and a slot ``c``, i.e. the row ``e * capacity + c`` of an ``[experts * capacity,
    model_dim]`` buffer; a dropped route points at one extra scratch row. Dispatch reads,
    for every buffer row, the token routed there (a slot nobody fills reads a zero row);
    combine reads every route's row back and sums the routes weighted by their gate value,
    in fp32, cast to the experts' dtype. Both are gathers (``index_select``), so their
    backward is an index-add and nothing depends on the order of writes. This moves
    ``tokens * k * model_dim`` elements, where GShard's one-hot einsum moves ``tokens *
    experts * capacity * model_dim``; the result is the same.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from .gate import Routing, TopKGate

__all__ = ["MOELayer", "combine", "dispatch"]

logger = logging.getLogger(__name__)


def _rows(routing: Routing, n_experts: int) -> torch.Tensor:
    """``[k, tokens]`` buffer rows of the routes; dropped routes: the scratch row."""
    scratch = n_experts * routing.capacity
    return torch.where(routing.experts >= 0, routing.experts * routing.capacity + routing.slots,
                       torch.full_like(routing.experts, scratch))


def dispatch(tokens: torch.Tensor, routing: Routing, n_experts: int) -> torch.Tensor:
    """``tokens`` ``[s, m]`` placed in ``[experts, capacity, m]`` (Note: dispatch by slot
    index)."""
    n_tokens, model_dim = tokens.shape
    rows = _rows(routing, n_experts)
    source = torch.full((n_experts * routing.capacity + 1,), n_tokens, dtype=torch.long,
                        device=tokens.device)
    token_ids = torch.arange(n_tokens, device=tokens.device).expand_as(rows)
    source.scatter_(0, rows.reshape(-1), token_ids.reshape(-1))   # only scratch collides
    padded = torch.cat([tokens, tokens.new_zeros(1, model_dim)])
    return padded.index_select(0, source[:-1]).view(n_experts, routing.capacity, model_dim)


def combine(expert_output: torch.Tensor, routing: Routing, n_experts: int) -> torch.Tensor:
    """``[experts, capacity, m]`` back to ``[s, m]``, each token the gate-weighted sum of
    its routes (Note: dispatch by slot index)."""
    model_dim = expert_output.shape[-1]
    rows = _rows(routing, n_experts)
    flat = expert_output.reshape(-1, model_dim)
    padded = torch.cat([flat, flat.new_zeros(1, model_dim)])
    routed = padded.index_select(0, rows.reshape(-1)).view(*rows.shape, model_dim)
    return (routed * routing.weights.unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)


class MOELayer(nn.Module):
    """The gate and the experts of one MoE layer (``MoE.deepspeed_moe``). ``forward(x,
    used_token)`` keeps ``x``'s shape and leaves the gate's ``l_aux`` and ``exp_counts``
    on the layer, as DeepSpeed does. Expert parallelism is not implemented: every rank
    runs every expert (``ep_size`` 1)."""

    def __init__(self, gate: TopKGate, experts: nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False   # Tutel's kernels are not used; the gathers above are exact
        if use_tutel:
            logger.warning("MoE(use_tutel=True): Tutel is not used; the layer runs without it")
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        model_dim = x.shape[-1]
        tokens = x.reshape(-1, model_dim)
        routing = self.gate(tokens, used_token)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        n_experts = self.ep_size * self.num_local_experts
        slots = dispatch(tokens, routing, n_experts)
        out = self.experts(slots.reshape(self.ep_size, self.num_local_experts, -1, model_dim))
        out = out.reshape(n_experts, -1, model_dim)
        return combine(out, routing, n_experts).reshape(x.shape)
