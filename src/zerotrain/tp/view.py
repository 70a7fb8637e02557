"""Checkpoint records with the tensor-parallel dimension gathered: the model as plain ZeRO
would shard it over every rank of the world.

Note: the gathered view
    A checkpoint records parameters by name and full shape, each cut into chunks over a
    world (``checkpoint/reshard.py``). With tensor parallelism a rank's records hold a
    data-parallel shard of its *slice* of each split parameter, which no chunk arithmetic
    over full parameters describes. So at save the records are gathered (over the
    data-parallel group, then the tensor-parallel group) into the full parameters, and each
    rank keeps its chunk of them under a layout over the whole world: the files are those
    of plain ZeRO at world N, and load into any T, any data-parallel size, and T = 1 by the
    existing resharding. Loading into a split model is the inverse: the loader fills such
    records, and :func:`scatter_view` gathers them over the world and cuts each rank's
    slice and shard back out. The cost is one record's full fp32 tensors on every rank
    during a save or load, record by record.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..comm import Communicator
from ..comm.mesh import Mesh
from ..core.flat import FlatLayout
from ..core.records import ShardRecord
from .split import SplitSpec, join_slices, local_slice

SpecOf = Callable[[str], Optional[SplitSpec]]


def _full_locals(layout: FlatLayout, shard: torch.Tensor, dp: Communicator,
                 shard_world: int) -> torch.Tensor:
    """The record's parameters whole (this rank's slices), concatenated flat."""
    if shard_world > 1:
        gathered = torch.empty(dp.world_size * shard.numel(), dtype=shard.dtype)
        dp.all_gather(gathered, shard.detach().cpu().contiguous(),
                      label="tensor parallel checkpoint view")
        matrix = gathered.view(dp.world_size, -1)
    else:
        matrix = shard.detach().cpu().view(1, -1)
    parts = []
    for slot in layout.slots:
        cols = matrix[:, layout.shard_slice(slot)].reshape(-1)
        parts.append(cols[: slot.numel])
    return torch.cat(parts) if parts else shard.new_zeros(0)


def gather_view(record: ShardRecord, mesh: Mesh, spec_of: SpecOf,
                shard_world: int) -> ShardRecord:
    """``record`` as a record of full parameters over the whole world (Note: the gathered
    view). Collective over the mesh: every rank calls it for the same records in order."""
    keys = [k for k, v in record.optimizer_state.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == record.master.numel()]
    fulls: dict[str, list[torch.Tensor]] = {}
    for key in ["master", *keys]:
        tensor = record.master if key == "master" else record.optimizer_state[key]
        flat = _full_locals(record.layout, tensor.float(), mesh.dp, shard_world)
        everyone = torch.empty(mesh.tp_size * flat.numel(), dtype=flat.dtype)
        mesh.tp.all_gather(everyone, flat, label="tensor parallel checkpoint view")
        rows = everyone.view(mesh.tp_size, -1)
        params, offset = [], 0
        for name, shape in zip(record.names, record.shapes):
            numel = int(torch.Size(shape).numel())
            pieces = [rows[t, offset: offset + numel].view(shape) for t in range(mesh.tp_size)]
            spec = spec_of(name)
            params.append(join_slices(pieces, spec) if spec else pieces[0].clone())
            offset += numel
        fulls[key] = params
    shapes = [tuple(p.shape) for p in fulls["master"]]
    layout = FlatLayout([p.numel() for p in fulls["master"]], world=mesh.world.world_size,
                        bucket_numel=record.layout.bucket_numel)
    rank = mesh.world.rank

    def shard_of(params: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(layout.shard_numel, dtype=torch.float32)
        for slot, full in zip(layout.slots, params):
            out[layout.shard_slice(slot)] = layout.shard_of_full(full, slot, rank)
        return out

    state = {k: v for k, v in record.optimizer_state.items() if k not in keys}
    state.update({k: shard_of(fulls[k]) for k in keys})
    return ShardRecord(names=list(record.names), shapes=shapes, layout=layout,
                       master=shard_of(fulls["master"]), optimizer_state=state,
                       group_index=record.group_index)


def scatter_view(view: ShardRecord, target: ShardRecord, mesh: Mesh, spec_of: SpecOf,
                 shard_rank: int, key: str) -> torch.Tensor:
    """``view``'s ``key`` (``master`` or a state tensor) cut into ``target``'s shard: the
    inverse of :func:`gather_view`. Returns a new tensor shaped like ``target.master``.
    Collective over the world."""
    tensor = view.master if key == "master" else view.optimizer_state[key]
    world = mesh.world.world_size
    gathered = torch.empty(world * tensor.numel(), dtype=torch.float32)
    mesh.world.all_gather(gathered, tensor.detach().float().cpu().contiguous(),
                          label="tensor parallel checkpoint view")
    matrix = gathered.view(world, -1)
    out = torch.zeros(target.master.numel(), dtype=torch.float32)
    for slot, vslot, name, shape in zip(target.layout.slots, view.layout.slots, view.names,
                                        view.shapes):
        full = matrix[:, view.layout.shard_slice(vslot)].reshape(-1)[: vslot.numel].view(shape)
        spec = spec_of(name)
        local = local_slice(full, spec, mesh.tp_rank) if spec else full
        out[target.layout.shard_slice(slot)] = target.layout.shard_of_full(
            local, slot, shard_rank)
    return out.to(device=target.master.device, dtype=target.master.dtype)
