"""What the engine needs from a ZeRO stage, and what a step reports back.

The protocol alone, so that the engine, checkpoints' owners and ``compile.py`` depend on
what a stage does, not on how stages 0-3 share their implementation (``base.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Protocol

import torch
from torch import nn

from ..offload import CopyLedger
from ..offload.traffic import HostTraffic
from ..core.records import ShardRecord


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """Result of one optimizer step at an accumulation boundary.

    applied: False when the step was skipped (fp16 overflow); parameters are then untouched.
    grad_norm: global L2 norm of the averaged, unscaled gradient over all ranks (inf on
    overflow, a nan gradient included, as DeepSpeed's ``get_global_grad_norm()`` reports).
    """

    applied: bool
    grad_norm: float
    nonfinite_params: tuple[str, ...] = ()   # parameters with an inf/nan gradient (some)


@dataclass(frozen=True)
class CompileTarget:
    """A module whose forward ``torch.compile`` traces whole (``compile.py``).

    ``name``: its path ('' for the model); ``around``: None, or a context manager factory
    entered around each compiled call (stage 3: sets aside the hooks of the modules inside,
    Note "compiled units" in ``zero3/stage.py``).
    """

    name: str
    module: nn.Module
    around: Optional[Callable[[], ContextManager[None]]] = None


class Stage(Protocol):
    """A ZeRO stage owns the gradients, the optimizer's shard and the parameter update."""

    optimizer: torch.optim.Optimizer
    partitions_parameters: bool   # parameters are shards between uses (stage 3)

    def begin_backward(self, boundary: bool, *, local: bool = False) -> None:
        """Called before each micro-step's backward; ``boundary`` if it ends accumulation.
        ``local``: keep this backward's gradients on this rank, to be reduced with the
        window's next reducing backward (stages 0-1, ``engine.no_sync``; StateError when
        the window was already reduced) or by :meth:`reduce_local` (stages 2-3, which hold
        them apart from the shard sums: ``coalesce_grad_reduction``)."""

    def reduce_local(self, boundary: bool) -> None:
        """Reduce what ``local`` backwards kept on this rank, as one backward with no
        gradients of its own would. Collective."""

    @property
    def delays_update(self) -> bool:
        """The update finishes at ``settle`` (``offload_optimizer.dpu``)."""

    @property
    def reductions_this_window(self) -> int:
        """Backwards reduced into the shard sums since the last update or ``zero_grad``."""

    @property
    def reduces_every_micro_step(self) -> bool:
        """Whether every backward outside ``local`` ones reduces its gradients (stages 2-3
        reduce-scatter them into shards): ``no_sync`` cannot keep them local there."""

    def finish_backward(self) -> None:
        """Called after backward: every gradient of this micro-step is reduced or stored."""

    def step(self, *, grad_scale: float, clip: float) -> StepOutcome:
        """Average, unscale (divide by ``grad_scale``), clip to ``clip`` (0 = off), step,
        and publish the updated parameters to the module on every rank (with a delayed
        update, the step runs on and ``settle`` publishes)."""

    def zero_grad(self) -> None:
        """Drop all accumulated gradients."""

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this stage holds, by category (parameters, gradients, optimizer_state)."""

    def shard_records(self) -> list[ShardRecord]:
        """This rank's optimizer shards, for checkpoints (live tensors: write to load)."""

    def frozen_records(self) -> list[ShardRecord]:
        """Shards of frozen parameters (stage 3 partitions them too; [] below stage 3)."""

    def publish_parameters(self) -> None:
        """Make the module's parameters equal the (possibly just loaded) master shards.
        Collective: every rank calls it."""

    def full_shape(self, tensor: torch.Tensor) -> torch.Size:
        """The full shape of one of the module's parameters or buffers (stage 3 partitions
        parameters, leaving them empty)."""

    def full_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous host copy of one of the module's parameters or buffers, full (stage
        3 gathers a partitioned parameter for the copy and releases it). Collective: every
        rank calls it for the same tensors in the same order."""

    def settle(self, *, before_step: bool = False) -> None:
        """Finish a delayed (``dpu``) update and publish it; no-op otherwise. Collective.
        Unless ``before_step``, host steps taken speculatively for the coming step are
        undone first (Note "speculation then validation" in offload/speculation.py)."""

    def close(self) -> None:
        """Release offload resources (threads, NVMe files)."""

    def take_timings(self) -> dict[str, float]:
        """Seconds by part of the offloaded step since the last call ({} without offload)."""

    @property
    def copy_ledger(self) -> CopyLedger:
        """Host <-> device copies by direction (Note "the copy ledger", offload/transfers.py)."""

    @property
    def host_traffic(self) -> HostTraffic:
        """Host memory bytes by phase of the step (Note "host traffic", offload/traffic.py)."""

    def memory_peaks(self) -> dict[str, int]:
        """Figures for ``memory_breakdown`` that are not tensors held now (bytes)."""

    def compile_targets(self, module: nn.Module) -> list[CompileTarget]:
        """The submodules of ``module`` whose forwards ``torch.compile`` may trace whole:
        no hook of the stage that gathers or releases runs inside them (``compile.py``)."""

    def movable_states(self, resident_only: bool = True) -> dict[str, list[torch.Tensor]]:
        """``engine.offload_states``: the tensors of each kind (DeepSpeed's
        ``OffloadStateTypeEnum`` names) that live on the training device now; with
        ``resident_only=False`` also those the config keeps on the host
        (``get_state_devices``)."""

    def state_views(self) -> list[torch.Tensor]:
        """Every tensor object the stage holds that may view those tensors' storages (Note
        "moving storages, not tensors" in offload/states.py)."""
