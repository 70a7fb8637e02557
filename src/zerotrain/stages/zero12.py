"""ZeRO stages 0, 1 and 2: replicated parameters, sharded optimizer (and gradients).

The three stages differ in two choices, both made by ``factory.build_stage``:

* the shard world: 1 for stage 0 (every rank steps the whole group, as DDP does), the data
  parallel world for stages 1 and 2 (each rank steps ``1/N`` of every group);
* the gradient reduction (``buckets.py``): all-reduce, reduce-scatter at the boundary, or
  reduce-scatter every micro-step.

Note: one step
    1. backward hooks hand each parameter's gradient to the buckets, which reduce it over
       ranks; the buckets end holding, per group, this rank's shard of the *summed*
       gradient;
    2. ``BucketedStage.step`` (stages/base.py) takes the global norm (one scalar all-reduce
       when sharded, from squares taken as the buckets completed) and skips on inf/nan; the
       update casts each shard to fp32, divides by the world size, unscales and clips in
       one multiply (on the device in both cases: ``offload/gradients.py``) and steps the
       optimizer over the fp32 shards (on the host when offloading);
    3. the updated shards are cast to the parameter dtype (on the device when offloading,
       after the fp32 values go up) and all-gathered piece by piece straight into the
       module's parameters (two pieces in flight at most; Note: publishing in place).
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .buckets import GradientBuckets
from ..comm import Communicator
from ..core.flat import Block, FlatLayout
from ..offload import Storage
from ..core.precision import PrecisionPolicy
from .base import BucketedStage, RecordArrivals, ShardRecord


@dataclass(frozen=True)
class ShardPlan:
    """How a stage shards and communicates (sizes in elements)."""

    shard_world: int
    reduce_bucket_numel: int
    allgather_bucket_numel: int
    overlap_comm: bool
    buckets: type[GradientBuckets]


@dataclass(slots=True)
class ShardedGroup:
    """One optimizer parameter group: its parameters and this rank's fp32 shard."""

    names: list[str]
    params: list[nn.Parameter]
    layout: FlatLayout
    master: torch.Tensor     # fp32, layout.shard_numel elements: what the optimizer steps
    aliased: bool            # the parameters are views of ``master`` (fp32, unsharded)
    group_index: int         # the optimizer parameter group


class ShardedDataParallel(BucketedStage):
    """Stages 0-2 over a module whose parameters stay whole on every rank.

    Note: publishing in place
        On a device, the updated shards are all-gathered straight into the parameters:
        a parameter's chunks, one per rank in rank order, are the parameter itself
        (Note: interleaved blocks in ``flat.py``), so each parameter is one gather's
        output and a piece's gathers go out as one launch. Only a parameter whose size
        the world does not divide (its last chunk padded) goes through a buffer of its
        own size and one copy. On the host, where each gather is a launch of its own,
        a piece is gathered into one buffer and copied out instead
        (``publish_in_place`` False).
    """

    partitions_parameters = False

    def __init__(self, groups: Sequence[tuple[list[str], list[nn.Parameter]]], *,
                 comm: Communicator, policy: PrecisionPolicy, plan: ShardPlan,
                 make_optimizer: Callable[[list[list[torch.Tensor]]], torch.optim.Optimizer],
                 storage: Storage, make_updater: Callable[[torch.optim.Optimizer], Any]
                 ) -> None:
        self.comm = comm
        self.policy = policy
        self.plan = plan
        self.storage = storage
        self.sharded = plan.shard_world > 1
        self.publish_in_place = comm.device.type != "cpu"   # Note: publishing in place
        self.shard_rank = comm.rank if self.sharded else 0
        self.device = next((p.device for _, ps in groups for p in ps), torch.device("cpu"))
        # an empty group (all its parameters frozen) has no shard; its optimizer group
        # stays, with no parameters, so the client's groups and schedulers line up
        self.groups = [self._shard_group(sub_names, sub_params, g)
                       for g, (names, params) in enumerate(groups) if params
                       for sub_names, sub_params in self._pieces(names, params)]
        self.optimizer = make_optimizer([[sg.master for sg in self.groups if sg.group_index == g]
                                         for g in range(len(groups))])
        self.updater = make_updater(self.optimizer)   # offload/updater.py
        self.updater.attach([g.master for g in self.groups])
        self.arrivals = RecordArrivals()   # Note "records as buckets complete" (base.py)
        self.buckets = plan.buckets([g.layout for g in self.groups], comm,
                                    accum_dtype=policy.grad_accum_dtype, device=self.device,
                                    overlap=plan.overlap_comm, comm_dtype=policy.reduce_dtype,
                                    on_reduced=self.record_reduced)
        self._grads_seen: set[tuple[int, int]] = set()   # (group, index) since the update
        self._hooks = [
            param.register_post_accumulate_grad_hook(functools.partial(self._on_grad, g, i))
            for g, group in enumerate(self.groups) for i, param in enumerate(group.params)]

    def close(self) -> None:
        """Release offload resources and the gradient hooks: the parameters are whole and
        current, so the module can be trained plainly or given to a new engine."""
        super().close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------------ set-up
    def _layout(self, params: Sequence[nn.Parameter]) -> FlatLayout:
        return FlatLayout([p.numel() for p in params], world=self.plan.shard_world,
                          bucket_numel=self.plan.reduce_bucket_numel)

    def _pieces(self, names: list[str], params: list[nn.Parameter]
                ) -> list[tuple[list[str], list[nn.Parameter]]]:
        """The group whole, or, when the host steps it, one piece per bucket, so that the
        host never needs more than one bucket's gradient at a time."""
        blocks = self._layout(params).blocks
        if not self.storage.steps_on_host() or len(blocks) <= 1:
            return [(names, params)]
        return [([names[i] for i in b.slots], [params[i] for i in b.slots]) for b in blocks]

    def _shard_group(self, names: list[str], params: list[nn.Parameter],
                     group_index: int) -> ShardedGroup:
        layout = self._layout(params)
        where = self.storage.zeros(0, self.policy.master_dtype).device   # allocates nothing
        _log_flattening(group_index, layout.shard_numel * self.policy.master_dtype.itemsize,
                        where)
        master = self.storage.zeros(layout.shard_numel, self.policy.master_dtype)
        for slot, param in zip(layout.slots, params):
            master[layout.shard_slice(slot)] = layout.shard_of_full(
                param.detach(), slot, self.shard_rank).to(master.dtype)
        aliased = (layout.world == 1 and not self.policy.has_master_copy
                   and self.storage.can_alias())
        if aliased:  # Note: master weights (precision.py): fp32 keeps no copy
            for slot, param in zip(layout.slots, params):
                param.data = master[layout.shard_slice(slot)].view(param.shape)
        return ShardedGroup(names, list(params), layout, master, aliased, group_index)

    def _on_grad(self, g: int, index: int, param: nn.Parameter) -> None:
        # not ready: a tile of a tiled computation (sequence/tiled.py); the tiles sum in
        # .grad and the last one hands the sum over
        if param.grad is None or not getattr(param, "ds_grad_is_ready", True):
            return
        self.buckets.begin(self._boundary)
        self.buckets.add(g, index, param.grad)
        param.grad = None
        self._grads_seen.add((g, index))

    def unused_parameters(self) -> list[str]:
        """The trained parameters that got no gradient since the last update (or
        ``zero_grad``), by name, in group order."""
        return [name for g, group in enumerate(self.groups)
                for i, name in enumerate(group.names) if (g, i) not in self._grads_seen]

    def zero_grad(self) -> None:
        super().zero_grad()
        self._grads_seen.clear()

    # ------------------------------------------------------------------ step
    def publish_record(self, k: int) -> None:
        """Write record (group) k's master shard into every rank's parameters (collective)."""
        group = self.groups[k]
        if group.aliased:
            return
        # offloaded: fp32 goes up and is cast on the device (offload/transfers.py)
        shard = self.storage.upload(group.master, self.policy.param_dtype)
        if group.layout.world > 1:
            self._gather_into_params(group, shard)
            return
        for block in group.layout.blocks:
            matrix = shard[block.shard_offset: block.shard_offset + block.chunk]
            self._copy_out(group, block, matrix.view(1, block.chunk))

    def _gather_into_params(self, group: ShardedGroup, shard: torch.Tensor) -> None:
        if self.publish_in_place:
            self._gather_straight_into_params(group, shard)
            return
        world = self.comm.world_size
        pieces = _gather_pieces(group.layout, self.plan.allgather_bucket_numel)

        def launch(piece: list[Block]):
            start = piece[0].shard_offset
            end = piece[-1].shard_offset + piece[-1].chunk
            out = torch.empty(world * (end - start), dtype=shard.dtype, device=shard.device)
            work = self.comm.all_gather(out, shard[start:end], async_op=True)
            return work, out.view(world, end - start), start

        in_flight = launch(pieces[0]) if pieces else None
        for k, piece in enumerate(pieces):
            assert in_flight is not None   # piece k was launched before the loop reached it
            work, matrix, start = in_flight
            in_flight = launch(pieces[k + 1]) if k + 1 < len(pieces) else None
            work.wait()
            for block in piece:
                offset = block.shard_offset - start
                self._copy_out(group, block, matrix[:, offset: offset + block.chunk])

    def _gather_straight_into_params(self, group: ShardedGroup, shard: torch.Tensor) -> None:
        """Note: publishing in place. Each piece's gathers go out together (one launch on
        NCCL), each parameter's chunks straight into the parameter; two pieces in flight."""
        pieces = _gather_pieces(group.layout, self.plan.allgather_bucket_numel)

        def launch(piece: list[Block]):
            outputs, inputs, padded = [], [], []
            for block in piece:
                for index in block.slots:
                    slot = group.layout.slots[index]
                    if slot.chunk == 0:
                        continue
                    full = group.params[index].detach()
                    part = shard[group.layout.shard_slice(slot)]
                    if (slot.numel == self.comm.world_size * slot.chunk
                            and full.is_contiguous() and full.dtype == part.dtype):
                        outputs.append(full.view(-1))
                    else:   # padded (or not a plain tensor): through a parameter-sized buffer
                        outputs.append(torch.empty(self.comm.world_size * slot.chunk,
                                                   dtype=part.dtype, device=part.device))
                        padded.append((outputs[-1], full))
                    inputs.append(part)
            work = self.comm.all_gather_into_many(outputs, inputs,
                                                  label=f"publish {piece[0].index}")
            return work, padded

        in_flight = launch(pieces[0]) if pieces else None
        for k in range(len(pieces)):
            assert in_flight is not None   # piece k was launched before the loop reached it
            work, padded = in_flight
            in_flight = launch(pieces[k + 1]) if k + 1 < len(pieces) else None
            work.wait()
            for gathered, full in padded:
                full.view(-1).copy_(gathered[: full.numel()])

    def _copy_out(self, group: ShardedGroup, block: Block, matrix: torch.Tensor) -> None:
        for index in block.slots:
            group.layout.copy_block_into_full(matrix, group.layout.slots[index],
                                              group.params[index].detach())

    # ------------------------------------------------------------------ state
    def shard_records(self) -> list[ShardRecord]:
        return [ShardRecord(names=list(g.names), shapes=[tuple(p.shape) for p in g.params],
                            layout=g.layout, master=g.master,
                            optimizer_state=self.optimizer.state[g.master],
                            group_index=g.group_index)
                for g in self.groups]

    # ------------------------------------------------------------------ offload_states
    def movable_states(self, resident_only: bool = True) -> dict[str, list[torch.Tensor]]:
        """Masters and their state where they are on the device (not offloaded, or kept by
        ``offload_optimizer.ratio``; all of them unless ``resident_only``), the
        parameters, the gradient buffers."""
        resident = self.storage.transfers.resident
        masters = [g.master for g in self.groups if not resident_only
                   or not self.storage.steps_on_host() or id(g.master) in resident]
        params: list[torch.Tensor] = [p for g in self.groups for p in g.params]
        states = self._gradient_states()
        states["lp_grads"] = states["lp_grads"] + [p.grad for p in params if p.grad is not None]
        return {"optim_states": self._state_of(masters), "hp_params": masters,
                "lp_params": params, **states}

    def state_views(self) -> list[torch.Tensor]:
        masters = [g.master for g in self.groups]
        params = [p for g in self.groups for p in g.params]
        return (masters + params + [p.grad for p in params if p.grad is not None]
                + self._state_of(masters) + self.buckets.tensors())

    # ------------------------------------------------------------------ memory
    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this stage holds, for distinct-storage accounting."""
        params: list[torch.Tensor] = [p for g in self.groups for p in g.params]
        out: dict[str, list[torch.Tensor]] = {
            "parameters": params,
            "gradients": self.buckets.tensors() + [p.grad for p in params
                                                   if p.grad is not None],
            self.state_category: [], "optimizer_state": [],
            "host_gradients": self.updater.host_tensors(),
        }
        resident = self.storage.transfers.resident   # offload_optimizer.ratio: on the device
        for g in self.groups:
            where = "optimizer_state" if id(g.master) in resident else self.state_category
            # list(): a delayed update's worker may be adding state entries meanwhile
            out[where] += [g.master] + [t for t in list(self.optimizer.state.get(
                g.master, {}).values()) if isinstance(t, torch.Tensor)]
        return out


def _log_flattening(group_index: int, nbytes: int, device: torch.device) -> None:
    """DeepSpeed's info line as each parameter group is flattened into this rank's shard,
    with whether the memory it lands in had room for it (free bytes before the shard is
    made). On zerotrain's root logger, not this module's: DeepSpeed's tools watch its one
    logger (``deepspeed.utils.logger``, which is zerotrain's through the switch)."""
    log = logging.getLogger("zerotrain")
    if not log.isEnabledFor(logging.INFO):
        return
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    room = "sufficient memory" if free >= nbytes else f"insufficient memory: {free} bytes free"
    log.info(f"Flattening param group {group_index} ({nbytes} bytes) on {device.type} ({room})")


def _gather_pieces(layout: FlatLayout, bucket_numel: int) -> list[list[Block]]:
    """Consecutive blocks grouped into all-gathers of at most ``bucket_numel`` elements."""
    pieces: list[list[Block]] = []
    size = 0
    for block in layout.blocks:
        full = layout.block_full_numel(block)
        if pieces and size + full <= bucket_numel:
            pieces[-1].append(block)
            size += full
        else:
            pieces.append([block])
            size = full
    return pieces
