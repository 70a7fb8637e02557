"""What the engine needs from a ZeRO stage, and what a step reports back.

The protocol alone, so that the engine, checkpoints' owners and ``compile.py`` depend on
what a stage does, not on how stages 0-3 share their implementation (``base.py``).

Note: the contract
    Everything the engine, checkpoints, ``zerotrain.utils`` and ``tp/`` ask of a stage is a
    member here, and ``base.py`` gives each capability that only some stages have a
    default that answers as the stage without it would (``grad_norm`` None,
    ``tensor_parallel_world_size`` 1, ``empty_partition_cache`` a no-op...). So outside
    ``stages/`` a stage is called, never probed (``getattr``/``hasattr``) and never written
    onto: what the engine keeps about a stage it holds lives in ``engine/ownership.py``,
    and tensor parallelism hands its norm over through :meth:`Stage.use_grad_norm`
    (``tests/test_layers.py`` checks both; docs/architecture.md has the table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch
from torch import nn

from ..comm import Communicator
from ..offload import CopyLedger
from ..offload.traffic import HostTraffic
from ..core.records import ShardRecord
from ..tp.split import SplitSpec


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


class NormSpan(Protocol):
    """How the gradient norm spans more than the stage's own group (tensor parallelism:
    ``tp/norm.py``): ``square`` is record ``index``'s contribution to the squared norm
    (parameters replicated over the other dimension weighted so that the sum over ``comm``
    counts them once), and ``comm`` the group the squares are summed over."""

    comm: Communicator

    def square(self, index: int, layout, shard: torch.Tensor) -> torch.Tensor:
        """fp32 scalar tensor (1 element)."""


class GradientReductions(Protocol):
    """What the engine asks of a stage's gradient buckets (``bucket_launch.py``): the
    reductions' group and function (vote plans compare them with the engine's), waiting
    for those in flight, and a record's reduced shard sum."""

    comm: Communicator
    reduce_scatter: Callable[..., Any]

    def collect(self) -> None:
        """Wait for every reduction in flight."""

    def reduced_shard(self, g: int) -> torch.Tensor:
        """Record ``g``'s reduced gradient sum, this rank's shard of it."""


class Stage(Protocol):
    """A ZeRO stage owns the gradients, the optimizer's shard and the parameter update
    (Note: the contract)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over the master shards."""

    @property
    def partitions_parameters(self) -> bool:
        """Parameters are shards between uses (stage 3)."""

    @property
    def comm(self) -> Communicator:
        """The group the stage shards and reduces over (the data-parallel one)."""

    @property
    def sharded(self) -> bool:
        """Whether the optimizer's shards differ between the ranks of ``comm``."""

    @property
    def data_parallel_world(self) -> Optional[int]:
        """The ranks gradients are averaged over when not ``comm``'s (MiCS, sequence
        parallelism); None: ``comm.world_size``."""

    @property
    def data_parallel_world_size(self) -> Optional[int]:
        """The engine's data-parallel size when the stage knows it better than the engine
        (tensor parallelism: world / T); None: the engine counts it."""

    @property
    def tensor_parallel_world_size(self) -> int:
        """Ranks each split layer is spread over; 1 without tensor parallelism."""

    @property
    def grad_norm(self) -> Optional[NormSpan]:
        """The norm over a wider group than ``comm`` (tensor parallelism); None: the
        stage's own."""

    def use_grad_norm(self, norm: NormSpan) -> None:
        """Take the gradient norm over ``norm``'s group from now on (before the first
        backward: tensor parallelism hands it over as it wraps the stage)."""

    @property
    def buckets(self) -> GradientReductions:
        """The gradient buckets (waiting for reductions; a record's reduced sum)."""

    def gradient_overwritten(self, g: int) -> None:
        """Record g's reduced gradient was written from outside (``utils.safe_set_*_grad``):
        what the stage derived from it on arrival is stale."""

    @property
    def gather_external(self) -> Optional[Callable[[nn.Parameter], None]]:
        """Stage 3's gather of a released parameter read in forward by a module its plan
        does not know (Note "external parameters at stage 3" in ``param_watch.py``); None
        where parameters are whole."""

    def unused_parameters(self) -> Optional[list[str]]:
        """Trained parameters without a gradient since the last update, by name; None
        where the stage does not track them (stage 3)."""

    def agree_on_call(self, call: str) -> None:
        """Before ``save_checkpoint``/``load_checkpoint`` (``call``): whatever the stage
        needs so that ranks not all making the call fail together (stage 3 on the host: a
        header); nothing elsewhere."""

    def empty_partition_cache(self) -> None:
        """Release gathered parameters nothing holds (stage 3); a no-op elsewhere."""

    def forward_hook_handles(self) -> list[Any]:
        """The handles of the module hooks that gather in forward (stage 3); [] elsewhere."""

    def take_tensor_parallel_bytes(self) -> Optional[dict[str, int]]:
        """Bytes of the tensor-parallel collectives since the last call, by operation;
        None without tensor parallelism."""

    def parameter_records(self) -> list[ShardRecord]:
        """This rank's records in the shapes its module holds (Note "slice or whole" in
        ``tp/stage.py``); ``shard_records`` where they are the same. Live tensors."""

    def split_of(self, name: str) -> Optional[tuple[SplitSpec, int]]:
        """(the split, this rank's place in the tensor-parallel group) of parameter
        ``name``; None when it is whole on every rank."""

    def publish_parameter_records(self) -> None:
        """After a write into :meth:`parameter_records`: publish the masters to the module.
        Collective."""

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
