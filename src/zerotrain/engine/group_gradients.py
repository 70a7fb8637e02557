"""DeepSpeed's per-group gradient views of the ZeRO optimizer (``_get_norm_groups()``,
``averaged_gradients``), read from the stage's reduced shards through the same records and
window rules as ``full_params.py``."""
from __future__ import annotations

from typing import Any

import torch

from .full_params import gradient_scale, parameter_records, record_index, reduced_gradient


def gradient_norms_by_group(engine: Any) -> list[torch.Tensor]:
    """The L2 norm of each optimizer group's gradient for this update (averaged over ranks,
    unscaled, before clipping), as DeepSpeed's ``optimizer._get_norm_groups()``: zeros when
    no backward ran since the last step. Collective at stages 1-3."""
    engine.settle()
    records = parameter_records(engine)
    groups = len(engine.optimizer.param_groups)
    squares = torch.zeros(groups, dtype=torch.float32)
    for record in records:
        summed = reduced_gradient(engine, record, "_get_norm_groups")
        if summed is None:
            break
        squares[record.group_index] += _squares(engine, record, summed).cpu()
    comm = _norm_comm(engine)
    if comm is not None:
        squares = squares.to(comm.device)
        comm.all_reduce(squares, label="_get_norm_groups")
    return list(squares.cpu().sqrt().div_(gradient_scale(engine)).unbind())


def averaged_gradients_by_group(engine: Any) -> dict[int, list[torch.Tensor]]:
    """This rank's chunk of each trained parameter's gradient (averaged over ranks, unscaled,
    fp32; new tensors), by optimizer group in the module's parameter order, as DeepSpeed's
    ``optimizer.averaged_gradients``: empty when no backward ran since the last step. A
    parameter none of whose elements this rank owns (stages 1-2) gives an empty chunk."""
    engine.settle()
    if not engine.accumulation_window.backward_in_window:
        return {}
    position = {name: i for i, (name, _) in enumerate(engine.module.named_parameters())}
    found: dict[int, list[tuple[int, torch.Tensor]]] = {}
    scale = gradient_scale(engine)
    for record in parameter_records(engine):
        if record.group_index < 0:   # a frozen parameter's shard (core.records.FROZEN)
            continue
        summed = reduced_gradient(engine, record, "averaged_gradients")
        assert summed is not None, "a backward ran in this window (checked above)"
        chunks = found.setdefault(record.group_index, [])
        for name, slot in zip(record.names, record.layout.slots):
            chunk = summed[record.layout.shard_slice(slot)]
            chunks.append((position[name], chunk.to(torch.float32, copy=True).div_(scale)))
    # stage 3 keeps a group's shards unit by unit; DeepSpeed lists the module's order
    return {g: [c for _, c in sorted(chunks, key=lambda pc: pc[0])]
            for g, chunks in sorted(found.items())}


def _squares(engine: Any, record: Any, summed: torch.Tensor) -> torch.Tensor:
    """A record's squared gradient norm as the step takes it: with a norm spanning a
    wider group (``stages/gradient_norm.py``'s ``NormSpan``: tensor parallelism), its
    weighted square, so a replicated parameter counts once over the group."""
    norm = engine.stage.grad_norm
    if norm is not None:
        return norm.square(record_index(engine, record), record.layout, summed.float())
    return torch.linalg.vector_norm(summed.float(), dtype=torch.float32).square()


def _norm_comm(engine: Any):
    """The ranks whose squares sum to the norm, as the step's; None when this rank holds
    it all."""
    norm = engine.stage.grad_norm
    if norm is not None:
        return norm.comm if norm.comm.world_size > 1 else None
    return engine.stage.comm if engine.stage.sharded else None
