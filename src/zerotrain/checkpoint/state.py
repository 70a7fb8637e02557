"""What a checkpoint reads from a running job and hands back: engine-agnostic records.

The checkpoint package never imports the engine or the stages. The engine describes
itself with a :class:`TrainingState`; the stage is reached only through
:class:`ShardOwner`, the three methods a checkpoint calls (every stage has them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from torch import nn

from ..comm import Communicator
from ..core.flat import FlatLayout
from ..core.records import ShardRecord
from .manifest import COUNTERS, CheckpointError

__all__ = ["COUNTERS", "CheckpointReport", "LoadResult", "ShardOwner", "TrainingState",
           "shard_rank", "writes_record"]


class ShardOwner(Protocol):
    """What a checkpoint needs from a stage: its shards, described as records, and a way to
    make the module follow them once a load has written into them."""

    def shard_records(self) -> list[ShardRecord]:
        """This rank's optimizer shards (live tensors: a load writes into them)."""

    def frozen_records(self) -> list[ShardRecord]:
        """Shards of frozen parameters the stage partitions ([] when it keeps them whole)."""

    def publish_parameters(self) -> None:
        """Make the module's parameters equal the (just loaded) master shards. Collective:
        every rank calls it."""

    @property
    def tensor_parallel_world_size(self) -> int:
        """Ranks each split layer is spread over (1 without tensor parallelism: then rank
        0's module is the whole model)."""


@dataclass(slots=True)
class TrainingState:
    """Everything a checkpoint saves or restores for one rank.

    ``optimizer`` is the torch optimizer over the master shards (its param groups carry the
    hyperparameters); ``counters`` maps each name in :data:`COUNTERS` to its value.
    ``lr_scheduler``, ``loss_scaler`` and ``data_loader`` are optional objects with
    ``state_dict()``/``load_state_dict()`` whose state is JSON.
    """

    module: nn.Module
    stage: ShardOwner
    optimizer: torch.optim.Optimizer
    comm: Communicator
    stage_index: int
    precision: str
    counters: dict[str, int]
    lr_scheduler: Any = None
    loss_scaler: Any = None
    data_loader: Any = None


@dataclass(slots=True)
class CheckpointReport:
    """What a save or load did on this rank. ``bytes_written``: files this rank wrote;
    ``elements_read``/``bytes_read``: master and optimizer-state elements (and frozen
    parameters and buffers) read from the checkpoint, random-generator state excluded."""

    path: Optional[str] = None
    seconds: float = 0.0
    bytes_written: int = 0
    elements_read: int = 0
    bytes_read: int = 0
    files_opened: int = 0


@dataclass(slots=True)
class LoadResult:
    """``path`` and ``client_state`` are what ``engine.load_checkpoint`` returns;
    ``counters`` (None when not restored) are for the engine to apply."""

    path: Optional[str]
    client_state: Optional[dict]
    counters: Optional[dict[str, int]] = None
    report: CheckpointReport = field(default_factory=CheckpointReport)


def shard_rank(layout: FlatLayout, comm: Communicator) -> int:
    """Which chunk of a layout this rank holds: all of it (0) for world-1 layouts, its own
    rank for layouts sharded over the whole group, its position in its group for layouts
    sharded over groups of consecutive ranks (MiCS: ranks ``r`` and ``r + S`` hold the same
    chunk)."""
    if layout.world == 1:
        return 0
    if comm.world_size % layout.world == 0:
        return comm.rank % layout.world
    raise CheckpointError(f"a shard layout of world {layout.world} in a process group of "
                          f"{comm.world_size} ranks is not supported by checkpoints")


def writes_record(layout: FlatLayout, comm: Communicator) -> bool:
    """Whether this rank writes its shard of a record: a layout over fewer ranks than the
    group is replicated (world 1: on every rank; MiCS: in every group), so only the first
    group of ranks writes it."""
    return comm.rank < layout.world
