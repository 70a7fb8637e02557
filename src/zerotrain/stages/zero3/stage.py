"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned.

Note: compiled units
    The engine compiles stage 3 per unit (``compile.py``): each unit module with no other
    unit inside gets a compiled forward, and its own hooks, which gather and release the
    unit, run eagerly around it. The modules inside have hooks too (Note: entry points in
    ``scheduler.py``), which only count the nesting depth while the unit is held; traced, they
    would make dynamo specialise each block's graph on its hooks' ids (one graph per
    block). So around each compiled call those hooks are set aside, when every unit they
    serve is one the compiled module holds itself.

Note: one stage-3 step
    Forward and backward gather each unit just before use and release it after
    (``scheduler.py``). Each parameter's gradient goes, from its post-accumulate hook, into its
    unit's reduce-scatter block (``buckets.ReduceScatterEveryMicroStep``, one block per unit
    and optimizer group, launched as soon as a unit's gradients are complete), so a rank only
    ever keeps its shard of the summed gradient. The step is stage 2's: average, global
    norm, unscale and clip, step the fp32 shards; then each unit's parameter-dtype shard is
    refreshed from its master. Nothing is all-gathered after the step: the next forward
    gathers what it needs.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..buckets import ReduceScatterEveryMicroStep
from ...comm import Communicator
from ...offload import Storage
from ...core.precision import PrecisionPolicy
from ..base import FROZEN, BucketedStage, RecordArrivals, ShardRecord
from . import partition as P
from .ds_attrs import ds_param
from ...errors import RankDivergenceError
from .gather_check import CALLS
from .hierarchical import build_groups
from .hooks import install_module_hooks
from .lockstep import mark_lockstep
from .scheduler import GatherPolicy, UnitScheduler
from .stage_hooks import UnitHooks, warn_if_partitioned
from .zero_init import GatheredParameters
from .plan import use_launch_plans
from .leaf import apply_leaf_module_config
from .unit import GroupSlice, Unit, UnitState
from .unit_specs import build_units
from .usage import UsageRecords


logger = logging.getLogger(__name__)


class PartitionedDataParallel(UnitHooks, BucketedStage):
    """Stage 3 over ``module``; parameters outside forward/backward are empty tensors."""

    partitions_parameters = True

    def __init__(self, module: nn.Module, groups: Sequence[list[nn.Parameter]], *,
                 comm: Communicator, policy: PrecisionPolicy, zero_config,
                 make_optimizer: Callable[[list[list[torch.Tensor]]], torch.optim.Optimizer],
                 storage: Storage, param_storage: Storage,
                 make_updater: Callable[[torch.optim.Optimizer], Any],
                 place_masters: Optional[Callable[[list[int]], list[Storage]]] = None
                 ) -> None:
        self.module = module
        groups3 = build_groups(comm, zero_config)   # hpZ, MiCS, qwZ, qgZ (hierarchical.py)
        comm = self.comm = groups3.shard
        self.wire = groups3.wire
        self.data_parallel_world = groups3.data_parallel_world
        self.policy = policy
        self.sharded = comm.world_size > 1
        group_of: dict[int, Optional[int]] = {id(p): g for g, ps in enumerate(groups)
                                              for p in ps}
        names = {id(p): n for n, p in module.named_parameters()}
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        apply_leaf_module_config(module, zero_config.leaf_module.model_dump())
        specs = build_units(module, unit_numel=int(zero_config.stage3_prefetch_bucket_size),
                            persistence_threshold=int(
                                zero_config.stage3_param_persistence_threshold))
        quantize_frozen = bool(zero_config.zero_quantized_nontrainable_weights)
        # where each unit's masters live (offload_optimizer.ratio keeps the first units'
        # on the device: storage.place_masters)
        counts = [len({group_of.get(id(p)) for p in spec.params} - {None}) for spec in specs]
        self._master_storage = (place_masters(counts) if place_masters is not None
                                else [storage] * len(specs))
        self.units = [Unit(spec, comm=comm, policy=policy, group_of=group_of, device=device,
                           storage=where, shard_storage=param_storage, wire=self.wire,
                           quantize_frozen=quantize_frozen)
                      for spec, where in zip(specs, self._master_storage)]
        # decoded frozen records handed to checkpoints: (unit, tensor, its version then)
        self._decoded: list[tuple[Unit, weakref.ref, int]] = []
        # records: one per (unit, optimizer group), in unit order; frozen slices apart
        self._records: list[tuple[Unit, GroupSlice]] = [
            (u, s) for u in self.units for s in u.slices if s.group is not None]
        self._frozen: list[tuple[Unit, GroupSlice]] = [
            (u, s) for u in self.units for s in u.slices if s.group is None]
        self._names = names
        # one view object per record: the optimizer keys its state (and reads .grad) by it
        self._masters = [unit.master_view(s) for unit, s in self._records]
        per_group: list[list[torch.Tensor]] = [[] for _ in groups]
        for (unit, s), master in zip(self._records, self._masters):
            assert s.group is not None   # _records holds the slices of optimizer groups
            per_group[s.group].append(master)
        self.optimizer = make_optimizer(per_group)
        self.updater = make_updater(self.optimizer)   # offload/updater.py
        where = {id(u): self._master_storage[i] for i, u in enumerate(self.units)}
        self._record_storage = [where[id(unit)] for unit, _ in self._records]
        self.updater.attach(self._masters, on_device=[
            k for k, place in enumerate(self._record_storage) if place is not storage])
        self.storage = storage
        self.param_storage = param_storage
        # on the host, plain reductions wait for the next header (Note "held reductions"
        # in gather_check.py)
        self._host_checked = comm.world_size > 1 and not comm.gathers_flat(device)
        reduce_scatter = groups3.reduce_scatter
        if reduce_scatter is None and self._host_checked:
            reduce_scatter = self.wire.host.reduce_scatter
        self.arrivals = RecordArrivals()   # Note "records as buckets complete" (base.py)
        self.buckets = ReduceScatterEveryMicroStep(
            [s.layout for _, s in self._records], comm, accum_dtype=policy.grad_accum_dtype,
            device=device, overlap=bool(zero_config.overlap_comm),
            comm_dtype=policy.reduce_dtype, reduce_scatter=reduce_scatter,
            on_reduced=self.record_reduced)
        usage = UsageRecords(module, self.units)   # DeepSpeed's records (Note: usage records)
        self.scheduler = UnitScheduler(self.units, GatherPolicy(
            prefetch_numel=int(zero_config.stage3_prefetch_bucket_size),
            max_live_numel=int(zero_config.stage3_max_live_parameters),
            max_reuse_distance=int(zero_config.stage3_max_reuse_distance)),
            usage=usage, on_pass=self.wire.check.begin_pass, on_use=self._note_use)
        self.wire.check.describe_units_with(self._describe_unit)
        self._uses = [(f"{self._describe_unit(i)} in forward",
                       f"{self._describe_unit(i)} in backward") for i in range(len(self.units))]
        self._handles = install_module_hooks(module, self.units, self.scheduler, usage)
        use_launch_plans(self, reduce_scatter)   # Note "launch plans" in plan.py
        mark_lockstep(module, True)
        self._handles.append(module.register_state_dict_post_hook(warn_if_partitioned))
        for r, (unit, s) in enumerate(self._records):
            for index, i in enumerate(s.indices):
                hook = functools.partial(self._on_grad, r, index, unit)
                self._handles.append(unit.spec.params[i].register_post_accumulate_grad_hook(hook))

    def _describe_unit(self, index: int) -> str:
        """``unit 3 (module 'moe.experts.1', Linear)`` for the gather check's errors."""
        if not 0 <= index < len(self.units):
            return f"unit {index} (no such unit here)"
        spec = self.units[index].spec
        kind = "leaf module" if spec.leaf else "module"
        return f"unit {index} ({kind} {spec.name or '<root>'!r}, {type(spec.module).__name__})"

    def _note_use(self, index: int, backward: bool) -> None:
        """A unit is used (Note "trace and prefetch" in scheduler.py): into the step's trail."""
        self.comm.ledger.trail.note("use", None, self._uses[index][backward])

    @property
    def gather_external(self) -> Callable[[nn.Parameter], None]:
        return self.pin_external

    def pin_external(self, param: nn.Parameter) -> None:
        """``param``, released, is read during the model's forward by a module its unit's
        plan does not know (Note "external parameters at stage 3" in
        ``stages/param_watch.py``): gather its unit and keep it until backward ends."""
        unit = getattr(param, "ds_unit", None)
        index = getattr(getattr(unit, "spec", None), "index", None)
        if index is not None and index < len(self.units) and self.units[index] is unit:
            self.scheduler.pin(index, leaving=-1)

    def _on_grad(self, record: int, index: int, unit: Unit, param: nn.Parameter) -> None:
        # not ready: a tile of a tiled computation (sequence/tiled.py); the tiles sum in
        # .grad and the last one hands the sum over (and counts as the unit's gradient)
        if param.grad is None or not getattr(param, "ds_grad_is_ready", True):
            return
        self.buckets.begin(self._boundary)
        self.buckets.add(record, index, param.grad)
        param.grad = None
        if not unit.spec.persistent:
            self.scheduler.gradient_arrived(unit.spec.index)

    # ------------------------------------------------------------------ backward and step
    def finish_backward(self) -> None:
        super().finish_backward()
        self.scheduler.end_backward()

    def step(self, *, grad_scale: float, clip: float):
        """Stage 2's step; on the host its all-reduce goes out after a header, as every
        stage-3 collective does (Note "held reductions" in gather_check.py)."""
        self.buckets.collect()
        if not self._host_checked:
            return super().step(grad_scale=grad_scale, clip=clip)
        self.wire.host.before_step(label="optimizer step")
        try:
            return super().step(grad_scale=grad_scale, clip=clip)
        except RankDivergenceError:
            if self.wire.host.plan is not None:   # the ranks' records differ: no plan
                self.wire.host.plan.forget()
            raise

    def agree_on_call(self, call: str) -> None:
        """Before ``save_checkpoint``/``load_checkpoint`` (``call``): on the host, a header
        that names it, so that ranks not all making the call raise RankDivergenceError
        together (``HostLaunches.before_call``); on a device the headers ride inside the
        unit gathers, so nothing is checked there."""
        if self._host_checked:
            code = next(k for k, v in CALLS.items() if v == call)
            self.wire.host.before_call(code)

    def settle(self, *, before_step: bool = False) -> None:
        """The base's settle (a delayed update joined and published), then the masters take what was written through ``ds_tensor``
        since the shards last followed them (Note "writes through ds_tensor" in
        partition.py): before each step, checkpoint save and ``eval()``. Local."""
        if not before_step:
            self.updater.retract()
        written = [u.spec.name or "<root>" for u in self.units if u.shard_written()]
        if self.updater.settle():   # a delayed update (dpu) was running: publish it
            if written:
                logger.warning("ds_tensor of unit(s) %s written while the delayed update "
                               "(offload_optimizer.dpu) ran: publishing the update rewrites "
                               "them from the masters", written)
            self.publish_parameters()
        changed = [u for u in self.units if u.shard_written()]
        if changed:
            self.updater.retract()   # a speculative step read the masters before the write
            for unit in changed:
                unit.take_shard_writes()

    def close(self) -> None:
        """Settle and release offload resources, then hand the module back partitioned, as
        after zero.Init: every unit released (persistent ones too) and every hook removed,
        so a new engine can take it (Note: one open engine per model, in engine.py)."""
        super().close()
        for unit in self.units:
            unit.drop_holders()
            unit.release(persistent_too=True)
        self.param_storage.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        mark_lockstep(self.module, False)

    def empty_partition_cache(self) -> None:
        """Release the gathered units nothing holds (DeepSpeed's ``empty_partition_cache``,
        called between steps: after an eval forward, say). Persistent units stay gathered:
        the hooks never gather them again."""
        for unit in self.units:
            if not (unit.spec.persistent or unit.held or unit.state is UnitState.RELEASED):
                unit.release()

    def publish_parameters(self) -> None:
        """After a load: frozen shards follow their (loaded) masters, int8 ones are quantized
        from what a load wrote into their records (Note: int8 frozen records), then the
        records."""
        for unit, s in self._frozen:
            unit.refresh_slice(s, unit.master_view(s))
        decoded, self._decoded = self._decoded, []
        for unit, ref, version in decoded:
            values = ref()
            if values is not None and values._version != version:
                assert unit.frozen is not None   # frozen_records decodes int8 units only
                unit.frozen.load_record(values)
                unit.shards_changed()
        super().publish_parameters()

    def publish_record(self, k: int) -> None:
        """Record k's parameter-dtype shard follows its master (no communication)."""
        if k == 0:
            # host shards may still be read by queued host-to-device copies of the last
            # backward (with dpu this runs right after it): let those land first
            self.param_storage.finish_sends()
        unit, s = self._records[k]
        if unit.shard is not unit.master:   # host to host, or sent up by the master's storage
            self.param_storage.fill_from_master(
                unit.shard[s.column: s.column + s.layout.shard_numel], self._masters[k],
                master_storage=self._record_storage[k])
        unit.shards_changed()   # hpZ's secondary copy is stale now

    def finish_publish(self) -> None:
        """Persistent units re-gather (collective); the others gather at their next use."""
        for unit in self.units:
            unit.regather()

    # ------------------------------------------------------------------ state
    def shard_records(self) -> list[ShardRecord]:
        out = []
        for (unit, s), master in zip(self._records, self._masters):
            params = [unit.spec.params[i] for i in s.indices]
            assert s.group is not None   # _records holds the slices of optimizer groups
            out.append(ShardRecord(
                names=[self._names[id(p)] for p in params],
                shapes=[tuple(ds_param(p).ds_shape) for p in params], layout=s.layout,
                master=master, optimizer_state=self.optimizer.state[master],
                group_index=s.group))
        return out

    def full_shape(self, tensor: torch.Tensor) -> torch.Size:
        return P.full_shape(tensor)   # a partitioned parameter is empty; ds_shape is its own

    def full_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A partitioned parameter is gathered for the copy and released after (a buffer, or
        a parameter whose unit is gathered, is copied as it is): an export holds one full
        parameter at a time beyond the shards."""
        with GatheredParameters([tensor]):
            return tensor.detach().to("cpu", copy=True).contiguous()

    def frozen_records(self) -> list[ShardRecord]:
        """Frozen parameters' shards: saved and loaded like records, never stepped.

        Note: int8 frozen records
            A unit's int8 frozen chunks (``frozen.py``) have no fp32 master to hand out, so
            their record's ``master`` is a new fp32 tensor of their decoded values: a save
            writes those (a checkpoint holds full-precision numbers, readable by
            ``consolidate`` and by a run without the key), and a load writes into it and
            then calls ``publish_parameters``, which quantizes every such tensor a load
            changed (its ``_version`` moved) back into place. Quantizing decoded values
            gives the same bytes (Note "exact scales" in ``quantize.py``). The tensors are
            held weakly: a save's are freed with its records. While a save or load holds
            them, the frozen chunks cost 4 bytes per element again.
        """
        self._decoded = [d for d in self._decoded if d[1]() is not None]
        out = []
        for unit, s in self._frozen:
            out.append(self._record(unit, s, unit.master_view(s)))
        for unit in self.units:
            if unit.frozen is not None:
                values = unit.frozen.record_values()
                self._decoded.append((unit, weakref.ref(values), values._version))
                out.append(self._record(unit, unit.frozen.slice, values))
        return out

    def _record(self, unit: Unit, s: GroupSlice, master: torch.Tensor) -> ShardRecord:
        params = [unit.spec.params[i] for i in s.indices]
        return ShardRecord(names=[self._names[id(p)] for p in params],
                           shapes=[tuple(ds_param(p).ds_shape) for p in params],
                           layout=s.layout,
                           master=master, optimizer_state={}, group_index=FROZEN)

    # ------------------------------------------------------------------ offload_states
    def movable_states(self, resident_only: bool = True) -> dict[str, list[torch.Tensor]]:
        """Masters and their state where they are on the device (not offloaded, or kept by
        ``offload_optimizer.ratio``), the parameter-dtype shards (with the full parameters
        of persistent units and int8 frozen chunks) unless ``offload_param`` keeps them on
        the host, and the gradient buffers; all of them, wherever they are, unless
        ``resident_only``."""
        on_device = [not resident_only or not place.steps_on_host()
                     for place in self._master_storage]
        masters = [u.master for u, here in zip(self.units, on_device) if here]
        views = [m for m, place in zip(self._masters, self._record_storage)
                 if not resident_only or not place.steps_on_host()]
        params: list[torch.Tensor] = []
        if not resident_only or not self.param_storage.steps_on_host():
            params = ([u.shard for u in self.units]
                      + [u.frozen.packed for u in self.units if u.frozen is not None]
                      + [u.full for u in self.units if u.spec.persistent])
        return {"optim_states": self._state_of(views), "hp_params": masters,
                "lp_params": params, **self._gradient_states()}

    def state_views(self) -> list[torch.Tensor]:
        out: list[Optional[torch.Tensor]] = []
        for u in self.units:
            out += [u.master, u.shard, u.full, *u.segments, *u.views]
            if u.frozen is not None:
                out.append(u.frozen.packed)
            for p in u.spec.params:
                out += [p, getattr(p, "ds_tensor", None), getattr(p, "ds_master", None)]
        return ([t for t in out if t is not None] + list(self._masters)
                + self._state_of(self._masters) + self.buckets.tensors())

    def memory_peaks(self) -> dict[str, int]:
        """Bytes of gathered parameters between forward and backward: when the last backward
        began, and the highest of those so far; with leaf modules, the largest leaf's full
        parameters, which are gathered at once."""
        size = self.units[0].full.element_size() if self.units else 0
        peaks = {"gathered_after_forward": self.scheduler.after_forward_numel * size,
                 "peak_gathered_after_forward": self.scheduler.peak_after_forward_numel * size}
        leaves = [u.numel for u in self.units if u.spec.leaf and not u.spec.persistent]
        if leaves:   # a leaf is gathered whole (Note "leaf modules" in leaf.py)
            peaks["largest_leaf_gathered"] = max(leaves) * size
        return peaks

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        shards = [u.shard for u in self.units] + [u.frozen.packed for u in self.units
                                                  if u.frozen is not None]
        full = [u.full for u in self.units]
        where = self.param_storage.memory_category("parameters")
        out = {"parameters": full, where: shards, "hpz_parameters": self.wire.tensors(),
               "gradients": self.buckets.tensors(), self.state_category: [],
               "host_gradients": self.updater.host_tensors()}
        for unit, place in zip(self.units, self._master_storage):   # ratio: some on device
            out.setdefault(place.memory_category("optimizer_state"), []).append(unit.master)
        for (unit, s), master, place in zip(self._records, self._masters,
                                            self._record_storage):
            # list(): a delayed update's worker may be adding state entries meanwhile
            out[place.memory_category("optimizer_state")] += [
                t for t in list(self.optimizer.state.get(master, {}).values())
                if isinstance(t, torch.Tensor)]
        return out
