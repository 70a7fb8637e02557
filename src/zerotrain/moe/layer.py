"""DeepSpeed's ``deepspeed.moe.layer.MoE`` at expert-parallel size 1.

Every rank holds every expert; the experts' parameters carry DeepSpeed's markers
(``moe/experts.py``) and train like any other parameter, their gradients averaged over the
data-parallel group, at every ZeRO stage. Expert parallelism (``ep_size`` > 1: experts
spread over ranks, tokens exchanged all-to-all, expert gradients averaged over an
expert-data-parallel group) is not implemented and refused by name.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..unsupported import UnsupportedFeatureError
from .dispatch import MOELayer
from .experts import Experts
from .gate import TopKGate

__all__ = ["MoE"]

logger = logging.getLogger(__name__)


class MoE(nn.Module):
    """A mixture-of-experts layer: ``forward(hidden_states, used_token=None)`` returns
    ``(output, l_aux, exp_counts)``, ``output`` of ``hidden_states``' shape, ``l_aux`` the
    gate's auxiliary (load-balancing) loss to add to the model's, ``exp_counts`` the routes
    each expert got. The arguments are DeepSpeed's (routing: ``moe/gate.py``, Note: routing
    semantics). ``use_residual``: Residual MoE, the output mixed with ``expert``'s own (one
    shared dense copy) by a learned softmax coefficient. ``use_tutel`` is accepted and
    runs the same layer (as DeepSpeed does without Tutel installed).
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1,
                 ep_size: int = 1, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        _check(num_experts, ep_size)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        logger.debug("MoE layer: %d experts, all on every rank (ep_size 1)", num_experts)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                        min_capacity, noisy_gate_policy, drop_tokens, use_rts,
                        top2_2nd_expert_sampling)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size,
                                      self.num_local_experts, use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed creates the expert groups here; at ``ep_size`` 1 the experts use the
        data-parallel group, so there is nothing to create."""

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + dense * mix[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _check(num_experts: int, ep_size: int) -> None:
    if num_experts < 1:
        raise ConfigError("MoE.num_experts", f"num_experts={num_experts} must be at least 1")
    if ep_size < 1 or num_experts % ep_size:
        raise ConfigError("MoE.ep_size", f"num_experts={num_experts} must be divisible by "
                          f"ep_size={ep_size}")
    if ep_size != 1:
        raise UnsupportedFeatureError(
            f"MoE(ep_size={ep_size}): expert parallelism (experts spread over ranks, tokens "
            "exchanged all-to-all) is not implemented; zerotrain's MoE layer needs ep_size=1 "
            "(every rank holds every expert, trained data-parallel)")
