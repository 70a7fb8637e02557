"""DeepSpeed's mixture-of-experts gate (``TopKGate``): which expert slots each token fills.

Note: routing semantics (GShard, as DeepSpeed's ``sharded_moe`` applies them)
    The gate's logits and probabilities are fp32 whatever the model's dtype. Each expert
    has ``capacity`` slots per forward: ``max(ceil(tokens / experts * factor * k),
    min_capacity)`` (``factor``: ``capacity_factor`` in training, ``eval_capacity_factor``
    in eval), or, with ``drop_tokens=False``, the largest number of routes any expert got.
    Routes over capacity are dropped: the token gets nothing from that expert (with k=1
    its MoE output is zero; the residual around the layer carries it).

    * k=1: each token goes to its most probable expert (the arg-max of the logits plus
      Gumbel noise under ``noisy_gate_policy='RSample'``), weighted by that probability.
      An expert over capacity keeps ``capacity`` of its tokens: random ones with
      ``use_rts`` (one uniform draw per token and expert, from torch's generator), the
      earliest ones without. ``used_token`` (1 or 0 per token) removes tokens from routing.
      Auxiliary loss: ``experts * sum_e(mean_prob_e * fraction_routed_e)``.
    * k=2: the second expert is the arg-max of the logits (plus Gumbel noise when
      ``top2_2nd_expert_sampling``) without the first; an expert's slots go to its
      first-choice tokens, then its second-choice ones, in token order; the two weights are
      renormalised to sum to 1. Auxiliary loss: ``experts**2 * mean_e(mean_prob_e *
      fraction_first_choice_e)``.
    * k>2: the k most probable experts; over capacity, an expert keeps the tokens that give
      it the highest probability; weights renormalised over the kept routes. Auxiliary
      loss: ``experts**2 / k * mean_e(mean_prob_e * fraction_routed_e)``.

    The result is a :class:`Routing`: per route (k rows, one column per token) the expert,
    the slot and the weight, the expert -1 where the route was dropped. Every random draw
    comes from torch's default generator, so a forward is deterministic given the seed, and
    no state crosses ranks (each rank routes its own micro-batch, as DeepSpeed does at
    ``ep_size`` 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

__all__ = ["Routing", "TopKGate", "top1_routing", "top2_routing", "topk_routing"]

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass(frozen=True)
class Routing:
    """Where a forward's tokens go. ``experts``, ``slots``, ``weights``: ``[k, tokens]``
    (long, long, fp32); ``experts`` is -1 for a dropped route (its weight is 0)."""
    l_aux: torch.Tensor        # fp32 scalar, differentiable through the gate's weight
    capacity: int              # slots per expert
    experts: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor      # differentiable through the gate's weight
    exp_counts: torch.Tensor   # [experts] routes per expert before dropping


def capacity_for(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """``max(ceil(tokens / experts * factor), min_capacity)``, the product in fp32 as
    DeepSpeed computes it (the ceiling of a product that lands near an integer agrees)."""
    scaled = torch.tensor(factor, dtype=torch.float32) * (tokens / experts)
    return max(int(math.ceil(scaled.item())), int(min_capacity))


def _uniform(shape: torch.Size, low: float, high: float, device) -> torch.Tensor:
    return low + torch.rand(shape, device=device) * (high - low)


def gumbel_noise(shape: torch.Size, device) -> torch.Tensor:
    """Standard Gumbel samples, ``-log(-log(u))`` with ``u`` uniform in (0, 1)."""
    tiny = torch.finfo(torch.float32).tiny
    u = _uniform(shape, tiny, 1.0 - torch.finfo(torch.float32).eps, device)
    return -torch.log(-torch.log(u))


def _routes(indices: torch.Tensor, kept: torch.Tensor, locations: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One route row: the expert (-1 where dropped) and the slot (0 where dropped)."""
    experts = torch.where(kept, indices, torch.full_like(indices, -1))
    return experts, torch.where(kept, locations, torch.zeros_like(locations))


def top1_routing(logits: torch.Tensor, *, capacity_factor: float, min_capacity: int,
                 used_token: Optional[torch.Tensor] = None, rsample: bool = False,
                 drop_tokens: bool = True, use_rts: bool = True) -> Routing:
    """k=1 routing of ``logits`` ([tokens, experts], fp32); see Note: routing semantics."""
    tokens, n_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    capacity = capacity_for(tokens, n_experts, capacity_factor, min_capacity)
    choice = logits + gumbel_noise(logits.shape, logits.device) if rsample else gates
    indices = torch.argmax(choice, dim=1)
    mask = F.one_hot(indices, num_classes=n_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = min(int(exp_counts.max()), tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * n_experts
    if tokens < min_capacity:
        raise ConfigError("MoE.min_capacity", f"a forward of {tokens} tokens is smaller than "
                          f"min_capacity={min_capacity}; lower min_capacity (0 is allowed) "
                          "or give the layer more tokens per forward")
    if use_rts:   # keep a random `capacity` of each expert's tokens
        priority = mask * torch.rand(mask.shape, device=mask.device)
        chosen = torch.topk(priority, k=min(capacity, tokens), dim=0).indices
        mask = mask * torch.zeros_like(mask).scatter_(0, chosen, 1)
    else:         # keep the first `capacity` of each expert's tokens
        mask = mask * (torch.cumsum(mask, dim=0) <= capacity).to(mask.dtype)
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    experts, slots = _routes(indices, mask.sum(dim=1) > 0, locations)
    weights = (gates * mask).sum(dim=1)
    return Routing(l_aux, capacity, experts.unsqueeze(0), slots.unsqueeze(0),
                   weights.unsqueeze(0), exp_counts)


def top2_routing(logits: torch.Tensor, *, capacity_factor: float, min_capacity: int,
                 drop_tokens: bool = True, second_sampling: bool = True) -> Routing:
    """k=2 routing of ``logits`` ([tokens, experts], fp32); see Note: routing semantics."""
    tokens, n_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=n_experts)
    if second_sampling:
        logits = logits + gumbel_noise(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=n_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * n_experts * n_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(tokens, n_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (locations1 < capacity)
        mask2 = mask2 * (locations2 < capacity)
    else:
        capacity = int(exp_counts.max())
    weight1 = (gates * mask1.float()).sum(dim=1)
    weight2 = (gates * mask2.float()).sum(dim=1)
    total = torch.clamp(weight1 + weight2, min=torch.finfo(gates.dtype).eps)
    e1, s1 = _routes(first, mask1.sum(dim=1) > 0, (locations1 * mask1).sum(dim=1))
    e2, s2 = _routes(second, mask2.sum(dim=1) > 0, (locations2 * mask2).sum(dim=1))
    return Routing(l_aux, capacity, torch.stack([e1, e2]), torch.stack([s1, s2]),
                   torch.stack([weight1 / total, weight2 / total]), exp_counts)


def topk_routing(logits: torch.Tensor, k: int, *, capacity_factor: float,
                 min_capacity: int, drop_tokens: bool = True) -> Routing:
    """k>2 routing of ``logits`` ([tokens, experts], fp32); see Note: routing semantics."""
    tokens, n_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * n_experts * n_experts / k
    if drop_tokens:   # each expert keeps the tokens that rate it highest
        capacity = capacity_for(tokens, n_experts, capacity_factor * k, min_capacity)
        rated = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        best = torch.topk(rated, k=min(capacity, tokens), dim=0, sorted=False).indices
        mask &= torch.zeros_like(mask).scatter_(0, best, True)
    else:
        capacity = int(exp_counts.max())
    locations = torch.cumsum(mask, dim=0) - 1
    kept_gates = gates * mask
    kept_gates = kept_gates / torch.clamp(kept_gates.sum(dim=-1, keepdim=True),
                                          min=torch.finfo(gates.dtype).eps)
    kept = mask.gather(1, top_idx)
    experts, slots = _routes(top_idx, kept, locations.gather(1, top_idx))
    return Routing(l_aux, capacity, experts.t().contiguous(), slots.t().contiguous(),
                   kept_gates.gather(1, top_idx).t().contiguous(), exp_counts)


class _Fp32Linear(nn.Linear):
    """The gate's projection, run in fp32 whatever dtype the model was cast to (routing
    decisions in bf16 flip on rounding). A module of its own so that stage 3 gathers its
    weight through the usual hooks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class TopKGate(nn.Module):
    """DeepSpeed's ``TopKGate``: ``wg`` (``model_dim -> num_experts``, no bias) and the
    routing of Note: routing semantics. ``forward(tokens [s, model_dim], used_token)``
    returns a :class:`Routing`."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ConfigError("MoE.k", f"k={k} must be between 1 and num_experts={num_experts}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ConfigError("MoE.noisy_gate_policy", f"{noisy_gate_policy!r} is not one of "
                              "None, 'None', 'Jitter', 'RSample'")
        self.wg = _Fp32Linear(model_dim, num_experts, bias=False)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(self, tokens: torch.Tensor, used_token: Optional[torch.Tensor] = None
                ) -> Routing:
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:   # x * U(0.99, 1.01)
            x = x * _uniform(x.shape, 1.0 - 1e-2, 1.0 + 1e-2, x.device)
        logits = self.wg(x)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1_routing(
                logits, capacity_factor=factor, min_capacity=self.min_capacity,
                used_token=used_token, drop_tokens=self.drop_tokens, use_rts=self.use_rts,
                rsample=self.training and self.noisy_gate_policy == "RSample")
        if self.k == 2:
            return top2_routing(logits, capacity_factor=factor, min_capacity=self.min_capacity,
                                drop_tokens=self.drop_tokens,
                                second_sampling=self.top2_2nd_expert_sampling)
        return topk_routing(logits, self.k, capacity_factor=factor,
                            min_capacity=self.min_capacity, drop_tokens=self.drop_tokens)
