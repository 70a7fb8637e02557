"""What stages 0-3 share once their gradients live in buckets: ``BucketedStage``.

The boundary flag, the records as their buckets complete, clearing, and the step
(``gradient_norm.prepare_gradients``, the update, then publishing). The protocol the
engine sees is ``protocol.py``; its names are re-exported here, where the engine and the
stages have always imported them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..comm import Communicator
from ..errors import StateError
from ..offload import CopyLedger, DeviceUpdater, HostUpdater, Storage
from ..offload.traffic import HostTraffic
from ..core.records import FROZEN, ShardRecord  # noqa: F401 (re-exported: the stages' old home of both)
from .bucket_launch import GradientBuckets
from .gradient_norm import prepare_gradients
# re-exported: the engine, compile.py and the stages import the protocol from here
from .protocol import CompileTarget, NormSpan, Stage, StepOutcome  # noqa: F401
from ..tp.split import SplitSpec


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
        the norm, because ``grad_norm`` may be handed over after construction
        (:meth:`use_grad_norm`: tensor parallelism wraps the stage once it is built).

    The capabilities only some stages have get their defaults here (Note "the contract"
    in ``protocol.py``): each answers as a stage without the capability would.
    """

    # set by each subclass (the docstring above), declared here for the shared methods
    optimizer: torch.optim.Optimizer
    comm: Communicator
    sharded: bool
    storage: Storage
    updater: "DeviceUpdater | HostUpdater"
    buckets: GradientBuckets

    if TYPE_CHECKING:   # implemented by each subclass
        def shard_records(self) -> list[ShardRecord]: ...

        def publish_record(self, k: int) -> None: ...

    _boundary = True
    data_parallel_world: Optional[int] = None   # ranks averaged over, if not comm's (MiCS)
    _grad_norm: Optional[NormSpan] = None   # the norm over a wider group (tensor parallel)
    arrivals: RecordArrivals

    # ------------------------------------------------------------------ the contract's defaults
    @property
    def grad_norm(self) -> Optional[NormSpan]:
        """The norm over a wider group than ``comm`` (tensor parallelism); None: own."""
        return self._grad_norm

    def use_grad_norm(self, norm: NormSpan) -> None:
        """Take the gradient norm over ``norm``'s group from now on."""
        self._grad_norm = norm

    @property
    def data_parallel_world_size(self) -> Optional[int]:
        """None: the engine counts its data-parallel ranks itself."""
        return None

    @property
    def tensor_parallel_world_size(self) -> int:
        return 1

    @property
    def gather_external(self) -> Optional[Callable[[nn.Parameter], None]]:
        """None: parameters are whole between uses (stage 3 gathers)."""
        return None

    def unused_parameters(self) -> Optional[list[str]]:
        """None: this stage does not track which parameters got a gradient."""
        return None

    def agree_on_call(self, call: str) -> None:
        """Nothing to agree on before ``call`` (stage 3 on the host sends a header)."""

    def empty_partition_cache(self) -> None:
        """Nothing is gathered between steps (stage 3 releases its units)."""

    def forward_hook_handles(self) -> list[Any]:
        """No module hooks gather in forward (stage 3's do)."""
        return []

    def take_tensor_parallel_bytes(self) -> Optional[dict[str, int]]:
        """None: no tensor-parallel collectives."""
        return None

    def parameter_records(self) -> list[ShardRecord]:
        """The module holds what the records describe: the shard records."""
        return self.shard_records()

    def split_of(self, name: str) -> Optional[tuple[SplitSpec, int]]:
        """None: every parameter is whole on every rank of the module."""
        return None

    def publish_parameter_records(self) -> None:
        self.publish_parameters()

    @property
    def reduces_every_micro_step(self) -> bool:
        return self.buckets.reduces_on(False)

    def begin_backward(self, boundary: bool, *, local: bool = False) -> None:
        holding = local and self.reduces_every_micro_step
        if holding:   # held until reduce_local (Note "held backwards" in buckets.py)
            boundary = False
        elif local:   # accumulate only; the window's reducing backward takes these too
            if self.buckets.reduced_this_window:
                raise StateError("a backward inside engine.no_sync() after a backward outside "
                                 "it already reduced this accumulation window's gradients; "
                                 "call engine.step() first")
            boundary = False
        if not self.buckets.active:
            self.buckets.holding = holding
        self._boundary = boundary
        if boundary and not self.buckets.active:
            self.arrivals.restart()

    def reduce_local(self, boundary: bool) -> None:
        """What backwards kept on this rank (``no_sync``, ``coalesce_grad_reduction``) goes
        over the ranks: one reducing backward with no gradients of its own, its blocks
        launched in the usual order and buckets (Note "held backwards" in buckets.py).
        Collective."""
        self.begin_backward(boundary)
        self.buckets.begin(boundary)
        self.buckets.finish()

    @property
    def reductions_this_window(self) -> int:
        """Backwards whose gradients were reduced into the shard sums since the last
        update or ``zero_grad`` (a held or only accumulated one is not counted)."""
        return self.buckets.reductions_this_window

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
