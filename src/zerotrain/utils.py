"""``zerotrain.utils``: DeepSpeed's ``deepspeed.utils`` helpers that training scripts call.

``logger`` and ``log_dist`` log as DeepSpeed's do. The ``safe_get_full_*`` /
``safe_set_full_fp32_param`` functions read and write one parameter's full fp32 master,
gradient or optimizer state, whichever stage holds it: each rank's chunk lives in its flat
shard (``flat.py``: rank r owns chunk r of every parameter), so the full value is the
concatenation of every rank's chunk. They are collective when the shards differ between
ranks (stages 1-3): every rank must call them, for the same parameter, in the same order.
They find the engine through the parameter, so call them after ``initialize``.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable, Optional

import torch

from .checkpoint.consolidate import (convert_zero_checkpoint_to_fp32_state_dict,
                                     get_fp32_state_dict_from_zero_checkpoint)
from .comm import get_rank, is_initialized
from .dataloader import RepeatingLoader
from .errors import StateError
from .core.log import ALL_RANKS
from .stages.zero3.leaf import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                         set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                         unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)

__all__ = ["RepeatingLoader", "convert_zero_checkpoint_to_fp32_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "log_dist", "logger",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "register_engine",
           # stage 3's leaf modules (zero3/leaf.py), DeepSpeed 0.19's names
           "get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]

logger = logging.getLogger("zerotrain")

_ENGINE_ATTR = "_zerotrain_engine"   # a weak reference to the engine training the parameter


def log_dist(message: str, ranks: Optional[list[int]] = None,
             level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ``ranks`` (``[-1]``: every rank), prefixed with the
    rank, as DeepSpeed's ``log_dist`` does. Without a process group it always logs; with
    one and ``ranks=None`` it logs nowhere (DeepSpeed's rule)."""
    rank = get_rank() if is_initialized() else -1
    should_log = not is_initialized()
    if ranks and not should_log:
        should_log = ranks[0] == -1 or rank in set(ranks)
    if should_log:
        logger.log(level, "[Rank %d] %s", rank, message, extra={ALL_RANKS: True})


# ------------------------------------------------------------------ full parameter access
def register_engine(engine: Any, params: Iterable[torch.nn.Parameter]) -> None:
    """Let the ``safe_*`` functions find ``engine`` from its parameters (``initialize``)."""
    ref = weakref.ref(engine)
    for p in params:
        setattr(p, _ENGINE_ATTR, ref)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The full fp32 master of ``param`` (a new tensor of its full shape), or None for a
    parameter the optimizer does not step. Collective at stages 1-3."""
    found = _locate(param, "safe_get_full_fp32_param")
    if found is None:
        return None
    engine, record, slot, shape = found
    return _gather_full(engine, record.master, record, slot, shape)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite the fp32 master of ``param`` with ``value`` (its full shape; each rank
    keeps its own chunk) and publish it to the module's parameters. Every rank must pass
    the same value. Collective at stages 1-3."""
    found = _locate(param, "safe_set_full_fp32_param")
    if found is None:
        raise StateError("safe_set_full_fp32_param: the parameter is not trained by the "
                         "engine (frozen or unknown); set it directly")
    engine, record, slot, shape = found
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"safe_set_full_fp32_param: value has shape {tuple(value.shape)}, "
                         f"the parameter has {tuple(shape)}")
    chunk = record.layout.shard_of_full(value.detach().to(record.master.dtype), slot,
                                        _shard_rank(engine, record))
    with torch.no_grad():
        record.master[record.layout.shard_slice(slot)].copy_(chunk)
    engine.stage.publish_parameters()


def safe_get_full_optimizer_state(param: torch.nn.Parameter,
                                  optim_state_key: str) -> Optional[torch.Tensor]:
    """The full value of optimizer state ``optim_state_key`` (``"exp_avg"``,
    ``"exp_avg_sq"``...) for ``param``; None before the first step or for a parameter the
    optimizer does not step. Collective at stages 1-3."""
    found = _locate(param, "safe_get_full_optimizer_state")
    if found is None:
        return None
    engine, record, slot, shape = found
    state = record.optimizer_state.get(optim_state_key)
    if state is None:
        return None
    if not isinstance(state, torch.Tensor) or state.shape != record.master.shape:
        raise ValueError(f"optimizer state {optim_state_key!r} is not a per-element tensor "
                         f"(it is {type(state).__name__}); read it from engine.optimizer.state")
    return _gather_full(engine, state, record, slot, shape)


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The full fp32 gradient of ``param`` for this update: averaged over ranks, divided
    by the fp16 loss scale, before clipping. Call it after ``engine.backward`` of the
    micro-step that ends the accumulation window and before ``engine.step()``, where
    DeepSpeed allows it too; None when no backward has run since the last step.
    Collective at stages 1-3."""
    found = _locate(param, "safe_get_full_grad")
    if found is None:
        return None
    engine, record, slot, shape = found
    if not engine._backward_in_window:
        return None
    if not engine.is_gradient_accumulation_boundary():
        raise StateError("safe_get_full_grad: gradients are reduced over ranks at the end "
                         "of the accumulation window; call it after the backward of its last "
                         f"micro-step (micro step {engine.micro_steps + 1} of "
                         f"{engine.gradient_accumulation_steps()} now)")
    buckets = engine.stage.buckets
    buckets.collect()
    index = [id(r.master) for r in engine.stage.shard_records()].index(id(record.master))
    summed = buckets.reduced_shard(index)
    grad = _gather_full(engine, summed, record, slot, shape).float()
    return grad.div_(engine.comm.world_size * engine.loss_scale)


def _locate(param: torch.nn.Parameter, what: str):
    """(engine, shard record, slot, full shape) of ``param``, or None if not trained."""
    ref = getattr(param, _ENGINE_ATTR, None)
    engine = ref() if ref is not None else None
    if engine is None:
        raise StateError(f"{what}: this parameter belongs to no engine; pass a parameter of "
                         "the model given to zerotrain.initialize()")
    names = {id(p): n for n, p in engine.module.named_parameters()}
    name = names.get(id(param))
    engine.settle()   # a delayed (dpu) update must land before masters are read or written
    for record in engine.stage.shard_records():
        if name in record.names:
            j = record.names.index(name)
            return engine, record, record.layout.slots[j], record.shapes[j]
    return None


def _shard_rank(engine: Any, record: Any) -> int:
    return engine.stage.comm.rank if record.layout.world > 1 else 0


def _gather_full(engine: Any, flat: torch.Tensor, record: Any, slot: Any,
                 shape: Any) -> torch.Tensor:
    """Every rank's chunk of ``slot`` from the shard-sized ``flat``, as the full tensor
    (gathered over the stage's shard group: the world, or a MiCS group)."""
    comm = engine.stage.comm
    chunk = flat[record.layout.shard_slice(slot)]
    if record.layout.world == 1:
        return chunk[: slot.numel].clone().view(shape)
    local = chunk.to(comm.device).contiguous()
    out = torch.empty(comm.world_size * slot.chunk, dtype=local.dtype, device=local.device)
    comm.all_gather(out, local, label="safe_get_full")
    return out[: slot.numel].view(shape)
