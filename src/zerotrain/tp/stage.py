"""A ZeRO stage over the data-parallel group of a tensor-parallel mesh, as the engine and
checkpoints see it.

The stage itself (stages 0-2, ``stages/zero12.py``, or stage 3, ``stages/zero3/``: Note
"tensor parallelism then stage 3" in ``zero3.py``) runs unchanged over ``mesh.dp`` on
parameters that are simply smaller; :class:`TensorParallelStage` adds what spans both
dimensions: the gradient norm (``norm.py``), checkpoint records with the tensor-parallel
dimension gathered (``view.py``), full copies for export, and the per-dimension report.
It implements the stage protocol (``stages/protocol.py``) member by member: what it adds
nothing to is delegated to the inner stage by name, never forwarded implicitly, and the
norm is handed over through the inner stage's ``use_grad_norm`` (Note "the contract" in
``stages/protocol.py``).

Note: slice or whole
    Two views of the same state exist under tensor parallelism. Checkpoints see full
    parameters chunked over the whole world (:meth:`TensorParallelStage.shard_records`,
    collective). The readers and writers of one parameter's state (``zerotrain.utils``'
    ``safe_get_full_*`` / ``safe_set_full_*``, ``optimizer.averaged_gradients``) see the
    parameter as this rank's module holds it, as DeepSpeed's AutoTP does: a split
    parameter is the rank's slice (full across the data-parallel ranks, whose chunks they
    gather), a replicated one the whole tensor. That view is
    :meth:`TensorParallelStage.parameter_records` (the stage's own records, no
    collective), and :meth:`TensorParallelStage.split_of` names the slice for messages.
    Stage 3, which partitions the slices over the data-parallel group, gives its records
    in the same terms (``ds_shape`` is the slice's shape), so nothing in the readers
    changes: its ``safe_get_local_*`` chunk is this data-parallel rank's part of the
    slice, and ``GatheredParameters`` gathers the slice over the data-parallel group.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..comm import Communicator
from ..core.records import ShardRecord
from .apply import TensorParallelPlan
from .norm import TensorParallelNorm
from .split import SplitSpec, join_slices
from .view import gather_view, scatter_view


class TensorParallelStage:
    """``stage`` (any stage, over ``plan.mesh.dp``) seen over the whole mesh."""

    def __init__(self, stage: Any, plan: TensorParallelPlan, module: nn.Module) -> None:
        self.inner = stage
        self.plan = plan
        self.mesh = plan.mesh
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._views: Optional[list[tuple[ShardRecord, ShardRecord]]] = None
        self._tp_mark: dict[str, int] = {}
        records = stage.shard_records()
        norm_comm = self.mesh.world if stage.sharded else self.mesh.tp
        stage.use_grad_norm(TensorParallelNorm(
            norm_comm, self.mesh.tp_size,
            [[plan.spec_of(n) is not None for n in r.names] for r in records]))

    # ------------------------------------------------------------------ sizes
    @property
    def data_parallel_world_size(self) -> int:
        return self.mesh.dp_size

    @property
    def tensor_parallel_world_size(self) -> int:
        return self.mesh.tp_size

    # ------------------------------------------------------------------ the inner stage's
    # (delegated by name: the inner stage works over ``mesh.dp`` and needs nothing more)
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.inner.optimizer

    @property
    def partitions_parameters(self) -> bool:
        return self.inner.partitions_parameters

    @property
    def comm(self) -> Communicator:
        return self.inner.comm

    @property
    def sharded(self) -> bool:
        return self.inner.sharded

    @property
    def data_parallel_world(self) -> Optional[int]:
        return self.inner.data_parallel_world

    @property
    def grad_norm(self) -> Any:
        return self.inner.grad_norm

    def use_grad_norm(self, norm: Any) -> None:
        self.inner.use_grad_norm(norm)

    @property
    def buckets(self) -> Any:
        return self.inner.buckets

    def gradient_overwritten(self, g: int) -> None:
        self.inner.gradient_overwritten(g)

    @property
    def gather_external(self) -> Optional[Callable[[nn.Parameter], None]]:
        return self.inner.gather_external

    def unused_parameters(self) -> Optional[list[str]]:
        return self.inner.unused_parameters()

    def agree_on_call(self, call: str) -> None:
        self.inner.agree_on_call(call)

    def empty_partition_cache(self) -> None:
        self.inner.empty_partition_cache()

    def forward_hook_handles(self) -> list[Any]:
        return self.inner.forward_hook_handles()

    def begin_backward(self, boundary: bool, *, local: bool = False) -> None:
        self.inner.begin_backward(boundary, local=local)

    def reduce_local(self, boundary: bool) -> None:
        self.inner.reduce_local(boundary)

    @property
    def delays_update(self) -> bool:
        return self.inner.delays_update

    @property
    def reductions_this_window(self) -> int:
        return self.inner.reductions_this_window

    @property
    def reduces_every_micro_step(self) -> bool:
        return self.inner.reduces_every_micro_step

    def finish_backward(self) -> None:
        self.inner.finish_backward()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        return self.inner.tensors_by_category()

    def settle(self, *, before_step: bool = False) -> None:
        self.inner.settle(before_step=before_step)

    def close(self) -> None:
        self.inner.close()

    def take_timings(self) -> dict[str, float]:
        return self.inner.take_timings()

    @property
    def copy_ledger(self) -> Any:   # offload's CopyLedger (a row tp does not import)
        return self.inner.copy_ledger

    @property
    def host_traffic(self) -> Any:   # offload's HostTraffic
        return self.inner.host_traffic

    def memory_peaks(self) -> dict[str, int]:
        return self.inner.memory_peaks()

    def compile_targets(self, module: nn.Module) -> list[Any]:
        return self.inner.compile_targets(module)

    def movable_states(self, resident_only: bool = True) -> dict[str, list[torch.Tensor]]:
        return self.inner.movable_states(resident_only)

    def state_views(self) -> list[torch.Tensor]:
        return self.inner.state_views()

    # stage 3's own, which DeepSpeed's ``parameter_offload`` reaches
    # (``engine/parameter_offload.py``; an AttributeError below stage 3, as before)
    @property
    def module(self) -> nn.Module:
        return self.inner.module

    @property
    def scheduler(self) -> Any:
        return self.inner.scheduler

    def reinstall_forward_hooks(self) -> None:
        self.inner.reinstall_forward_hooks()

    # ------------------------------------------------------------------ training
    def step(self, *, grad_scale: float, clip: float):
        self._views = None   # the gathered view of the last save is stale from here
        return self.inner.step(grad_scale=grad_scale, clip=clip)

    # ------------------------------------------------------------------ checkpoints
    def _shard_world(self) -> int:
        return self.mesh.dp_size if self.inner.sharded else 1

    def shard_records(self) -> list[ShardRecord]:
        """Records of full parameters over the whole world (Note "the gathered view" in
        ``view.py``). Collective over the mesh."""
        live = self.inner.shard_records()
        views = [gather_view(r, self.mesh, self.plan.spec_of, self._shard_world())
                 for r in live]
        self._views = list(zip(views, live))
        return views

    def frozen_records(self) -> list[ShardRecord]:
        """None: at stages 0-2 frozen parameters are whole in the module file (this rank's
        slice of a split one); stage 3 with tensor parallelism refuses frozen parameters
        (``zero3.py``), so none is partitioned outside the gathered records."""
        return []

    def parameter_records(self) -> list[ShardRecord]:
        """This rank's records in its module's shapes: a split parameter's slice (Note
        "slice or whole"). Live tensors; no collective."""
        return self.inner.shard_records()

    def split_of(self, name: str) -> Optional[tuple[SplitSpec, int]]:
        """(the split, this rank's place in the tensor-parallel group) of parameter
        ``name``, or None when it is whole on every rank (Note "slice or whole")."""
        spec = self.plan.spec_of(name)
        return None if spec is None else (spec, self.mesh.tp_rank)

    def publish_parameter_records(self) -> None:
        """After a write into :meth:`parameter_records`: publish the masters to the
        module. The gathered view of an earlier save is stale from here, as after a
        step. Collective over the data-parallel group."""
        self._views = None
        self.inner.publish_parameters()

    def publish_parameters(self) -> None:
        """After a load wrote into the gathered view: cut it back into this rank's shards
        (masters, and optimizer state when it was loaded), then publish. Collective."""
        views, self._views = self._views, None
        optimizer = self.inner.optimizer
        # this rank's place among the stage's shards: its rank in the data-parallel group
        # (stage 3 names no ``shard_rank``; its records are chunked over ``comm`` alike)
        shard_rank = self.inner.comm.rank if self.inner.sharded else 0
        for view, live in views or []:
            loaded_state = view.master in optimizer.state
            state = optimizer.state.pop(view.master, None) if loaded_state else None
            master = scatter_view(view, live, self.mesh, self.plan.spec_of, shard_rank,
                                  "master")
            with torch.no_grad():
                live.master.copy_(master)
            if state is None:
                continue
            view.optimizer_state = state
            fresh = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() == view.master.numel() \
                        and value.dim() > 0:
                    fresh[key] = scatter_view(view, live, self.mesh, self.plan.spec_of,
                                              shard_rank, key)
                else:
                    fresh[key] = value
            live.optimizer_state.clear()
            live.optimizer_state.update(fresh)
            optimizer.state[live.master] = live.optimizer_state
        self.inner.publish_parameters()

    # ------------------------------------------------------------------ export
    def full_shape(self, tensor: torch.Tensor) -> torch.Size:
        spec = self.plan.spec_of(self._names.get(id(tensor), ""))
        shape = self.inner.full_shape(tensor)
        return torch.Size(spec.full_shape(shape)) if spec else shape

    def full_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor on the host; a split parameter is gathered over the
        tensor-parallel group (collective over it: every rank, same tensors, same order)."""
        local = self.inner.full_copy(tensor)
        spec = self.plan.spec_of(self._names.get(id(tensor), ""))
        if spec is None:
            return local
        everyone = torch.empty(self.mesh.tp_size * local.numel(), dtype=local.dtype)
        self.mesh.tp.all_gather(everyone, local.reshape(-1), label="tensor parallel export")
        pieces = list(everyone.view(self.mesh.tp_size, *local.shape).unbind(0))
        return join_slices(pieces, spec)

    # ------------------------------------------------------------------ reports
    def take_tensor_parallel_bytes(self) -> dict[str, int]:
        """Bytes of the tensor-parallel collectives since the last call, by operation."""
        now = dict(self.mesh.tp.ledger.nbytes)
        before = self._tp_mark
        self._tp_mark = now
        return {op: n - before.get(op, 0) for op, n in now.items() if n - before.get(op, 0)}

    def dimensions(self) -> dict[str, Any]:
        """Sizes and traffic of each dimension of the mesh (bytes by collective)."""
        module_numel = {"split": 0, "replicated": 0}
        for record in self.inner.shard_records():
            for name, slot in zip(record.names, record.layout.slots):
                kind = "split" if self.plan.spec_of(name) else "replicated"
                module_numel[kind] += slot.numel
        return {"tensor_parallel": {"size": self.mesh.tp_size, "rank": self.mesh.tp_rank,
                                    "comm_bytes": dict(self.mesh.tp.ledger.nbytes),
                                    "comm_calls": dict(self.mesh.tp.ledger.calls)},
                "data_parallel": {"size": self.mesh.dp_size, "rank": self.mesh.dp_rank,
                                  "comm_bytes": dict(self.mesh.dp.ledger.nbytes)},
                "parameters_per_rank": module_numel}
