"""What a stage hands to checkpoints: flat fp32 shards described by parameter name.

These types sit below both sides: the stages build them, ``checkpoint/`` saves and loads
them, and neither has to import the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .flat import FlatLayout

__all__ = ["FROZEN", "ShardRecord"]

FROZEN = -1   # ShardRecord.group_index of a frozen parameter's shard (no optimizer group)


@dataclass(slots=True)
class ShardRecord:
    """One flat fp32 tensor the optimizer steps on this rank, described well enough to be
    saved, resharded and loaded without knowing which stage produced it.

    ``master`` holds this rank's chunks of ``names`` at ``layout.shard_slice(slot)``;
    ``optimizer_state`` is the optimizer's live state dict for ``master`` (tensors of the
    same size, like ``exp_avg``, and scalars, like ``step``; empty before the first step);
    ``group_index`` is the optimizer parameter group it belongs to, or ``FROZEN`` for the
    shards of frozen parameters that stage 3 partitions too (no optimizer state).
    """

    names: list[str]
    shapes: list[tuple[int, ...]]
    layout: FlatLayout
    master: torch.Tensor
    optimizer_state: dict[str, Any]
    group_index: int
