"""DeepSpeed's ``Experts``: one copy of the expert module per expert, marked as DeepSpeed
marks them (``allreduce = False``, ``group_name``), so that
``moe.utils.split_params_into_different_moe_groups_for_optimizer`` puts their parameters in
groups of their own. At ``ep_size`` 1 every rank holds every expert and the engine averages
their gradients over the data-parallel group like any other parameter's."""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional

import torch
from torch import nn

__all__ = ["Experts"]


@contextlib.contextmanager
def _whole(module: nn.Module) -> Iterator[None]:
    """``module``'s parameters whole while it is copied: built under ``zero.Init`` they are
    partitioned (a copy would get empty tensors), so they are gathered with DeepSpeed's
    per-parameter API (collective: every rank builds the same layers) and partitioned again
    afterwards; the copies are plain tensors that ``zero.Init`` partitions when the layer's
    construction returns."""
    partitioned = [p for p in module.parameters() if hasattr(p, "all_gather")
                   and hasattr(p, "partition")]
    for p in partitioned:
        p.all_gather()
    try:
        yield
    finally:
        for p in partitioned:
            p.partition()


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert`` (``deepspeed_experts``, DeepSpeed's
    parameter names). ``forward`` takes the dispatched tokens ``[groups, experts, capacity,
    model_dim]``, gives expert ``e`` its slice ``[:, e:e+1]`` and concatenates the outputs;
    an expert returning a tuple (output, bias) contributes its first element."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1,
                 expert_group_name: Optional[str] = None) -> None:
        super().__init__()
        with _whole(expert):
            self.deepspeed_experts = nn.ModuleList(
                copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        for copied in self.deepspeed_experts:
            for param in copied.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1),
                                 self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)
