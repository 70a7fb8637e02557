"""What the engine needs from a ZeRO stage, and what a step reports back."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Mapping, Optional, Protocol, Sequence

import torch
from torch import nn

from ..comm import Communicator
from ..comm.trail import first_difference
from ..errors import RankDivergenceError, StateError
from ..offload import CopyLedger, Gradients
from ..offload.traffic import HostTraffic
from ..core.records import FROZEN, ShardRecord  # noqa: F401 (re-exported: the stages' old home of both)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """Result of one optimizer step at an accumulation boundary.

    applied: False when the step was skipped (fp16 overflow); parameters are then untouched.
    grad_norm: global L2 norm of the averaged, unscaled gradient over all ranks (inf/nan on
    overflow).
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
    delays_update: bool   # the update finishes at ``settle`` (offload_optimizer.dpu)
    partitions_parameters: bool   # parameters are shards between uses (stage 3)

    def begin_backward(self, boundary: bool, *, local: bool = False) -> None:
        """Called before each micro-step's backward; ``boundary`` if it ends accumulation.
        ``local``: keep this backward's gradients on this rank, to be reduced with the
        window's next reducing backward (``engine.no_sync``); StateError where the stage
        cannot (``reduces_every_micro_step``) or the window was already reduced."""

    @property
    def reduces_every_micro_step(self) -> bool:
        """Whether every backward reduces its gradients (stages 2-3 reduce-scatter them into
        shards), so that none can stay local to one rank."""

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

    def movable_states(self) -> dict[str, list[torch.Tensor]]:
        """``engine.offload_states``: the tensors of each kind (DeepSpeed's
        ``OffloadStateTypeEnum`` names) that live on the training device now."""

    def state_views(self) -> list[torch.Tensor]:
        """Every tensor object the stage holds that may view those tensors' storages (Note
        "moving storages, not tensors" in offload/states.py)."""


class NormSpan(Protocol):
    """How the gradient norm spans more than the stage's own group (tensor parallelism:
    ``tp/norm.py``): ``square`` is record ``index``'s contribution to the squared norm
    (parameters replicated over the other dimension weighted so that the sum over ``comm``
    counts them once), and ``comm`` the group the squares are summed over."""

    comm: Communicator

    def square(self, index: int, layout, shard: torch.Tensor) -> torch.Tensor:
        """fp32 scalar tensor (1 element)."""


@dataclass(slots=True)
class RecordArrivals:
    """The records whose gradient became final in the boundary micro-step, in the order
    they did, with each one's squared norm (Note: records as buckets complete)."""

    squares: dict[int, torch.Tensor] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)

    def restart(self) -> None:
        """A new boundary backward: nothing has arrived."""
        self.squares = {}
        self.order = []

    def add(self, g: int, square: torch.Tensor) -> None:
        self.squares[g] = square
        self.order.append(g)

    def forget_square(self, g: int) -> None:
        """Record g's gradient was rewritten: its square is stale (the step retakes it)."""
        self.squares.pop(g, None)

    def step_order(self, count: int) -> list[int]:
        """All ``count`` records: those that arrived, in arrival order, then the rest."""
        arrived = self.order
        return arrived + [k for k in range(count) if k not in set(arrived)]


class BucketedStage:
    """What the stages share once gradients live in ``self.buckets``: the boundary flag,
    clearing, and the step (``prepare_gradients``, the update, then publishing).

    A subclass sets ``optimizer``, ``comm``, ``sharded`` (whether the optimizer's shards
    differ between ranks), ``storage`` (where masters live), ``updater``
    (``offload.build_updater``: how they are stepped), ``arrivals`` (a fresh
    :class:`RecordArrivals`) and then ``buckets``, built with
    ``on_reduced=self.record_reduced``; it implements ``shard_records`` (one record per
    bucket layout, in the same order) and ``publish_record`` (record k's master to the
    module's parameters; collective).

    Note: records as buckets complete
        In the boundary micro-step, as each record's last bucket is reduced, its squared
        norm is taken on the device and, when offloading, its copy to the host starts
        (``updater.stream``); the step then only sums the squares and waits for the
        copies it needs, record by record, in the order the records completed. The
        buckets call :meth:`record_reduced`, a bound method rather than an object holding
        the norm, because ``grad_norm`` may be set after construction (tensor parallelism).
    """

    _boundary = True
    data_parallel_world: Optional[int] = None   # ranks averaged over, if not comm's (MiCS)
    grad_norm: Optional[NormSpan] = None   # the norm over a wider group (tensor parallel)
    arrivals: RecordArrivals

    @property
    def reduces_every_micro_step(self) -> bool:
        return self.buckets.reduces_on(False)

    def begin_backward(self, boundary: bool, *, local: bool = False) -> None:
        if local:   # accumulate only; the window's reducing backward takes these too
            if self.reduces_every_micro_step:
                raise StateError("this stage reduces every backward's gradients, so none "
                                 "can stay local")
            if self.buckets.reduced_this_window:
                raise StateError("a backward inside engine.no_sync() after a backward outside "
                                 "it already reduced this accumulation window's gradients; "
                                 "call engine.step() first")
            boundary = False
        self._boundary = boundary
        if boundary and not self.buckets.active:
            self.arrivals.restart()

    def record_reduced(self, g: int, shard: torch.Tensor) -> None:
        """The buckets' ``on_reduced``: record g's reduced ``shard`` is final for this
        window (Note: records as buckets complete)."""
        self.arrivals.add(g, self.grad_norm.square(g, self.buckets.layouts[g], shard)
                          if self.grad_norm is not None else
                          torch.linalg.vector_norm(shard, dtype=torch.float32).square())
        self.updater.stream(g, shard, self.data_parallel_world or self.comm.world_size)

    def finish_backward(self) -> None:
        self.buckets.finish()

    def gradient_overwritten(self, g: int) -> None:
        """Group g's reduced gradient was written from outside (``utils.safe_set_*_grad``):
        its squared norm taken on arrival is stale and a copy streamed to the host, or a
        step speculated from it, must not be used."""
        self.arrivals.forget_square(g)
        self.updater.forget()

    def zero_grad(self) -> None:
        self.updater.retract()   # gradients discarded: no speculative step stands
        self.buckets.collect()
        self.buckets.clear()

    def step(self, *, grad_scale: float, clip: float) -> StepOutcome:
        self.buckets.collect()
        records = self.shard_records()
        summed = [self.buckets.reduced_shard(i) for i in range(len(records))]
        grads = prepare_gradients(records, summed, comm=self.comm, sharded=self.sharded,
                                  grad_scale=grad_scale, clip=clip,
                                  wire=[self.buckets.exact_dtype(i) for i in range(len(records))],
                                  squares=self.arrivals.squares,
                                  average_over=self.data_parallel_world,
                                  norm=self.grad_norm)
        if isinstance(grads, StepOutcome):   # inf/nan: nothing is stepped
            self.updater.forget()
            self.zero_grad()
            return grads
        # the update (offload/updater.py: on the device, or record by record on the host,
        # in the order the records completed, the same on every rank)
        self.updater.step([r.master for r in records], grads.gradients,
                          publish=self.publish_record,
                          order=self.arrivals.step_order(len(records)))
        if not self.updater.delayed:
            self.finish_publish()
        self.zero_grad()
        return StepOutcome(True, grads.norm)

    @property
    def state_category(self) -> str:
        """Where the optimizer state is counted: on the device, in host memory, on NVMe."""
        return self.storage.memory_category("optimizer_state")

    @property
    def delays_update(self) -> bool:
        return self.updater.delayed

    def frozen_records(self) -> list[ShardRecord]:
        return []

    def full_shape(self, tensor: torch.Tensor) -> torch.Size:
        return tensor.shape   # below stage 3 the module's tensors are whole on every rank

    def full_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu", copy=True).contiguous()

    def memory_peaks(self) -> dict[str, int]:
        return {}

    def settle(self, *, before_step: bool = False) -> None:
        """Finish a delayed (``dpu``) update and publish it; no-op otherwise. Collective.
        Unless ``before_step``, speculative host steps are undone first."""
        if not before_step:
            self.updater.retract()
        if self.updater.settle():
            self.publish_parameters()

    def publish_parameters(self) -> None:
        """Make the module's parameters equal the master shards (collective)."""
        for k in range(len(self.shard_records())):
            self.publish_record(k)
        self.finish_publish()

    def finish_publish(self) -> None:
        """After every record is published (stage 3 re-gathers its persistent units)."""

    def close(self) -> None:
        """Release offload resources (threads, NVMe files)."""
        self.updater.close()

    def take_timings(self) -> dict[str, float]:
        """Seconds by part of the offloaded step since the last call ({} without offload)."""
        return self.updater.take_timings()

    @property
    def copy_ledger(self) -> CopyLedger:
        return self.storage.transfers.ledger

    @property
    def host_traffic(self) -> HostTraffic:
        return self.storage.transfers.host

    def compile_targets(self, module: nn.Module) -> list[CompileTarget]:
        """The whole module: these stages hook only parameters, never module calls."""
        return [CompileTarget("", module)]

    def _state_of(self, masters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The optimizer's state tensors of ``masters``."""
        return [t for m in masters for t in list(self.optimizer.state.get(m, {}).values())
                if isinstance(t, torch.Tensor)]

    def _gradient_states(self) -> dict[str, list[torch.Tensor]]:
        """The buckets' tensors as ``offload_states`` names them: reduced shard sums
        (``lp_grads``) and accumulation or staging buffers (``contiguous_grad_buffer``)."""
        reduced = self.buckets.reduced_tensors()
        ids = {id(t) for t in reduced}
        return {"lp_grads": reduced,
                "contiguous_grad_buffer": [t for t in self.buckets.tensors()
                                           if id(t) not in ids]}


@dataclass(frozen=True, slots=True)
class PreparedGradients:
    gradients: Gradients   # per record: the reduced shard and how to finish it
    norm: float


def prepare_gradients(records: Sequence[ShardRecord], summed: Sequence[torch.Tensor], *,
                      comm: Communicator, sharded: bool, grad_scale: float, clip: float,
                      wire: Sequence[torch.dtype] = (),
                      squares: Optional[Mapping[int, torch.Tensor]] = None,
                      average_over: Optional[int] = None,
                      norm: Optional[NormSpan] = None
                      ) -> "PreparedGradients | StepOutcome":
    """What every stage does before the update (Note "one step" in ``stages/zero12.py``).

    ``summed[i]`` is record i's gradient shard summed over ranks, left as it is: the update
    averages, unscales and clips it (Note "one arithmetic" in ``offload/gradients.py``).
    Here the global L2 norm of the averaged, unscaled gradient is taken (one scalar
    all-reduce when ``sharded``), from ``squares[i]`` where a record's squared norm was
    already taken as its buckets completed. On inf/nan the result is the failed
    StepOutcome naming the first parameter affected. With ``norm`` (tensor parallelism)
    the squares are ``norm.square``'s, summed over ``norm.comm`` rather than ``comm``.
    """
    world = average_over or comm.world_size   # MiCS: the shard group is not the world
    squares = squares or {}
    sq = torch.zeros(1, dtype=torch.float32, device=summed[0].device if summed else None)
    for i, shard in enumerate(summed):
        part = squares.get(i)
        if part is None:
            part = (norm.square(i, records[i].layout, shard) if norm is not None else
                    torch.linalg.vector_norm(shard, dtype=torch.float32).square())
        sq += part
    if norm is not None and norm.comm.world_size > 1:   # summed over both dimensions
        sq = _reduce_with_fingerprint(sq, norm.comm, True)
    elif comm.world_size > 1:   # stage 0 too: the norm's all-reduce carries the fingerprint
        sq = _reduce_with_fingerprint(sq, comm, sharded)
    norm = float(sq.sqrt().item()) / world / grad_scale
    if not math.isfinite(norm):
        return StepOutcome(False, norm, _nonfinite_names(records, summed, comm, sharded))
    coef = 1.0 / grad_scale
    if clip > 0:
        coef *= min(1.0, clip / (norm + 1e-6))
    wire = list(wire) or [shard.dtype for shard in summed]
    return PreparedGradients(Gradients(list(summed), wire, world, coef, 1.0 / grad_scale),
                             norm)


def _reduce_with_fingerprint(sq: torch.Tensor, comm: Communicator,
                             sharded: bool) -> torch.Tensor:
    """All-reduce the squared norm (only its own when not ``sharded``: stage 0 sums full
    gradients already) with the step's collective fingerprint beside it; raise
    RankDivergenceError on every rank when the ranks' fingerprints differ (Note "step
    fingerprint" in ``comm/trail.py``). Returns the squared norm."""
    trail = comm.ledger.trail
    carried = torch.tensor(trail.carried(), dtype=sq.dtype, device=sq.device)
    wire = torch.cat([sq, carried]) if sharded else carried
    comm.all_reduce(wire, label="gradient norm" if sharded else "step fingerprint",
                    carried=len(carried))
    sums = wire[-len(carried):].tolist()
    if comm.carries_data and not trail.agreed(sums, comm.world_size):
        trails = comm.all_gather_object(list(trail.entries), label="divergence report")
        trail.restart()
        raise RankDivergenceError(
            f"rank {comm.rank}: the ranks made different collectives in this step "
            f"({first_difference(trails)}). A rank took another path: a forward on some "
            "ranks only, an exception caught in the middle of backward, a module or "
            "engine call skipped on one rank. Every rank must run the same forwards, "
            "backwards and steps; see docs/divergence.md")
    trail.restart()
    return wire[:1] if sharded else sq


def _nonfinite_names(records: Sequence[ShardRecord], grads: Sequence[torch.Tensor],
                     comm: Communicator, sharded: bool, limit: int = 64) -> tuple[str, ...]:
    """Names of parameters whose gradient chunk is not finite, from every rank (at most
    ``limit`` per rank); only called on the failure path."""
    local: list[str] = []
    for record, grad in zip(records, grads):
        if bool(torch.isfinite(grad).all()):
            continue
        for j, slot in enumerate(record.layout.slots):
            if not bool(torch.isfinite(grad[record.layout.shard_slice(slot)]).all()):
                local.append(record.names[j])
        if len(local) >= limit:
            break
    everyone = comm.all_gather_object(local[:limit]) if sharded else [local[:limit]]
    return tuple(dict.fromkeys(name for names in everyone for name in names))
