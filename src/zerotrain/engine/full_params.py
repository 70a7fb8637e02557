"""Engine internals behind DeepSpeed's ``safe_get_full_*`` / ``safe_set_*`` functions
(``zerotrain.utils`` exports them): find a parameter's engine, shard record and slot, and
read or write its fp32 master, gradient or optimizer state, whole or this rank's chunk.

Each rank's chunk lives in its flat shard (``flat.py``: rank r owns chunk r of every
parameter), so the full value is the concatenation of every rank's chunk. The full
functions are collective when the shards differ between ranks (stages 1-3): every rank must
call them, for the same parameter, in the same order. They find the engine through the
parameter (:func:`register_engine`, at ``initialize``).

Under tensor parallelism (``tensor_parallel.autotp_size``) they work in the shape the
rank's module holds, as DeepSpeed's AutoTP does: a split parameter's value is the rank's
slice, whole across the data-parallel ranks (a script all-gathers the slices over its
tensor-parallel group), a replicated one the whole tensor. :func:`parameter_records` is the
one place that chooses those terms (Note "slice or whole" in ``tp/stage.py``).
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch

from ..errors import StateError

_ENGINE_ATTR = "_zerotrain_engine"   # a weak reference to the engine training the parameter


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
    _check_shape("safe_set_full_fp32_param", value, shape, engine, param)
    chunk = record.layout.shard_of_full(value.detach().to(record.master.dtype), slot,
                                        _shard_rank(engine, record))
    with torch.no_grad():
        record.master[record.layout.shard_slice(slot)].copy_(chunk)
    _publish(engine)


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
    summed = reduced_gradient(engine, record, "safe_get_full_grad")
    if summed is None:
        return None
    grad = _gather_full(engine, summed, record, slot, shape).float()
    return grad.div_(gradient_scale(engine))


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the gradient of ``param`` that the next ``engine.step()`` applies with
    ``value`` (its full shape, in :func:`safe_get_full_grad`'s terms: averaged over ranks,
    unscaled); every rank passes the same value. Same window rule as the getter.
    A frozen parameter is left alone (DeepSpeed's rule). Collective at stages 1-3."""
    found = _locate(param, "safe_set_full_grad")
    if found is None:
        return
    engine, record, slot, shape = found
    _check_shape("safe_set_full_grad", value, shape, engine, param)
    chunk = record.layout.shard_of_full(value.detach().reshape(-1), slot,
                                        _shard_rank(engine, record))
    _write_grad_chunk(engine, record, slot, chunk, "safe_set_full_grad")


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor,
                                  optim_state_key: str) -> None:
    """Overwrite optimizer state ``optim_state_key`` of ``param`` with ``value`` (its full
    shape; each rank keeps its own chunk). Collective at stages 1-3."""
    found = _locate(param, "safe_set_full_optimizer_state")
    if found is None:
        return
    engine, record, slot, shape = found
    _check_shape("safe_set_full_optimizer_state", value, shape, engine, param)
    state = _state_tensor(record, optim_state_key, "safe_set_full_optimizer_state")
    chunk = record.layout.shard_of_full(value.detach().reshape(-1), slot,
                                        _shard_rank(engine, record))
    with torch.no_grad():
        state[record.layout.shard_slice(slot)].copy_(chunk)


def safe_update_full_grad_vectorized(param_list: Iterable[torch.nn.Parameter],
                                     update_func: Any) -> None:
    """``safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))`` for every
    parameter of ``param_list`` that requires a gradient, in order (every rank passes the
    same list). Collective at stages 1-3."""
    for p in param_list:
        if p.requires_grad:
            grad = safe_get_full_grad(p)
            if grad is not None:
                safe_set_full_grad(p, update_func(grad, p))


# ------------------------------------------------------------------ stage 3: this rank's chunk
# DeepSpeed defines these for ZeRO-3 partitioned parameters only: the rank's own chunk of
# the parameter (``ceil(numel / world)`` elements, the last rank's zero-padded), flat.
# They are local: no collective, so ranks may call them for different parameters.
def safe_get_local_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """This rank's chunk of the fp32 master of ``param`` (a view: writing it changes the
    master, as in DeepSpeed); None for a frozen parameter."""
    found = _locate_local(param, "safe_get_local_fp32_param")
    if found is None:
        return None
    _, record, slot = found
    return record.master[record.layout.shard_slice(slot)]


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's chunk of the fp32 master of ``param`` and publish it to the
    module's parameter. Frozen parameters are left alone."""
    found = _locate_local(param, "safe_set_local_fp32_param")
    if found is None:
        return
    engine, record, slot = found
    _check_chunk("safe_set_local_fp32_param", value, slot)
    with torch.no_grad():
        record.master[record.layout.shard_slice(slot)].copy_(value.detach().reshape(-1))
    _publish(engine)


def safe_get_local_optimizer_state(param: torch.nn.Parameter,
                                   optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's chunk of optimizer state ``optim_state_key`` of ``param`` (a view);
    None for a frozen parameter or before the first step."""
    found = _locate_local(param, "safe_get_local_optimizer_state")
    if found is None:
        return None
    _, record, slot = found
    if record.optimizer_state.get(optim_state_key) is None:
        return None
    state = _state_tensor(record, optim_state_key, "safe_get_local_optimizer_state")
    return state[record.layout.shard_slice(slot)]


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor,
                                   optim_state_key: str) -> None:
    """Overwrite this rank's chunk of optimizer state ``optim_state_key`` of ``param``."""
    found = _locate_local(param, "safe_set_local_optimizer_state")
    if found is None:
        return
    _, record, slot = found
    _check_chunk("safe_set_local_optimizer_state", value, slot)
    state = _state_tensor(record, optim_state_key, "safe_set_local_optimizer_state")
    with torch.no_grad():
        state[record.layout.shard_slice(slot)].copy_(value.detach().reshape(-1))


def safe_get_local_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """This rank's chunk of the gradient :func:`safe_get_full_grad` returns (fp32,
    averaged over ranks, unscaled; a new tensor); same window rule. None for a frozen
    parameter or when no backward has run since the last step."""
    found = _locate_local(param, "safe_get_local_grad")
    if found is None:
        return None
    engine, record, slot = found
    summed = reduced_gradient(engine, record, "safe_get_local_grad")
    if summed is None:
        return None
    chunk = summed[record.layout.shard_slice(slot)].to(torch.float32, copy=True)
    return chunk.div_(gradient_scale(engine))


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's chunk of the gradient the next ``engine.step()`` applies (in
    :func:`safe_get_local_grad`'s terms). Frozen parameters are left alone."""
    found = _locate_local(param, "safe_set_local_grad")
    if found is None:
        return
    engine, record, slot = found
    _check_chunk("safe_set_local_grad", value, slot)
    _write_grad_chunk(engine, record, slot, value.detach().reshape(-1), "safe_set_local_grad")


def _locate_local(param: torch.nn.Parameter, what: str):
    """(engine, record, slot) of a stage-3 parameter, None if frozen; refuses below 3."""
    found = _locate(param, what)
    engine = getattr(param, _ENGINE_ATTR)()
    if not engine.stage.partitions_parameters:
        raise StateError(f"{what} is defined for ZeRO stage 3's partitioned parameters "
                         f"only (this engine runs stage {engine.zero_optimization_stage()}); "
                         f"use the safe_*_full_* functions")
    if found is None:
        return None
    return found[0], found[1], found[2]


def _check_shape(what: str, value: torch.Tensor, shape: Any, engine: Any,
                 param: torch.nn.Parameter) -> None:
    """One line naming the parameter, the shape expected and, for a parameter split over
    the tensor-parallel group, that it is this rank's slice (Note "slice or whole")."""
    if tuple(value.shape) == tuple(shape):
        return
    name = _name_of(engine, param)
    split = _split_of(engine, name)
    if split is None:
        expected = f"its shape {tuple(shape)}"
    else:
        spec, tp_rank = split
        expected = (f"tensor-parallel rank {tp_rank}'s slice {tuple(shape)} (of "
                    f"{spec.full_shape(shape)}, split on dimension {spec.dim} over "
                    f"{spec.size} ranks)")
    raise ValueError(f"{what}: value for {name} has shape {tuple(value.shape)}; expected "
                     f"{expected}")


def _check_chunk(what: str, value: torch.Tensor, slot: Any) -> None:
    if value.numel() != slot.chunk:
        raise ValueError(f"{what}: value has {value.numel()} elements, this rank's chunk of "
                         f"the parameter has {slot.chunk}")


def _state_tensor(record: Any, key: str, what: str) -> torch.Tensor:
    state = record.optimizer_state.get(key)
    if state is None:
        raise StateError(f"{what}: the optimizer has no state {key!r} for this parameter "
                         f"(it has {sorted(record.optimizer_state)}; state is made by the "
                         "first step)")
    if not isinstance(state, torch.Tensor) or state.shape != record.master.shape:
        raise ValueError(f"optimizer state {key!r} is not a per-element tensor (it is "
                         f"{type(state).__name__}); use engine.optimizer.state")
    return state


def reduced_gradient(engine: Any, record: Any, what: str) -> Optional[torch.Tensor]:
    """This rank's reduced (summed, scaled) gradient shard holding ``record``; None when no
    backward ran in this window. Refused before the window's last backward."""
    window = engine.accumulation_window
    if not window.backward_in_window:
        return None
    if window.coalescing:
        raise StateError(f"{what} inside coalesce_grad_reduction(): the block's gradients "
                         "are still this rank's alone, reduced over ranks at its exit; "
                         "call it after the block, before engine.step()")
    if not engine.managed_gradient_accumulation() and not window.in_step:
        raise StateError(f"{what}: with managed_gradient_accumulation=False the window's "
                         "gradients are reduced over ranks only inside engine.step(), which "
                         "ends the window and clears them after the update")
    if not engine.is_gradient_accumulation_boundary():
        raise StateError(f"{what}: gradients are reduced over ranks at the end of the "
                         "accumulation window; call it after the backward of its last "
                         f"micro-step (micro step {engine.micro_steps + 1} of "
                         f"{engine.gradient_accumulation_steps()} now)")
    engine.stage.buckets.collect()
    return engine.stage.buckets.reduced_shard(record_index(engine, record))


def record_index(engine: Any, record: Any) -> int:
    return [id(r.master) for r in parameter_records(engine)].index(id(record.master))


def parameter_records(engine: Any) -> list:
    """The stage's records in the shapes this rank's module holds: under tensor
    parallelism a split parameter's slice, not the checkpoints' gathered view (Note
    "slice or whole" in ``tp/stage.py``). The one place the readers choose their terms."""
    return engine.stage.parameter_records()


def _split_of(engine: Any, name: Optional[str]):
    """(split spec, tensor-parallel rank) of a split parameter, else None."""
    return engine.stage.split_of(name) if name else None


def _publish(engine: Any) -> None:
    """Publish masters written through :func:`parameter_records` to the module's parameters."""
    engine.stage.publish_parameter_records()


def gradient_scale(engine: Any) -> float:
    """What the reduced gradient holds over the averaged, unscaled one: the sum over the
    data-parallel ranks (the world without tensor parallelism), times the loss scale."""
    return engine.dp_world_size * engine.loss_scale


def _write_grad_chunk(engine: Any, record: Any, slot: Any, chunk: torch.Tensor,
                      what: str) -> None:
    """Store ``chunk`` (averaged, unscaled) where the step reads the summed, scaled shard."""
    summed = reduced_gradient(engine, record, what)
    if summed is None:
        raise StateError(f"{what}: no gradient to replace; call it after engine.backward() "
                         "and before engine.step()")
    with torch.no_grad():
        summed[record.layout.shard_slice(slot)].copy_(
            chunk.float() * gradient_scale(engine))
    engine.stage.gradient_overwritten(record_index(engine, record))


def _locate(param: torch.nn.Parameter, what: str):
    """(engine, shard record, slot, full shape) of ``param``, or None if not trained."""
    ref = getattr(param, _ENGINE_ATTR, None)
    engine = ref() if ref is not None else None
    if engine is None:
        raise StateError(f"{what}: this parameter belongs to no engine; pass a parameter of "
                         "the model given to zerotrain.initialize()")
    name = _name_of(engine, param)
    engine.settle()   # a delayed (dpu) update must land before masters are read or written
    for record in parameter_records(engine):
        if name in record.names:
            j = record.names.index(name)
            return engine, record, record.layout.slots[j], record.shapes[j]
    return None


def _name_of(engine: Any, param: torch.nn.Parameter) -> Optional[str]:
    return next((n for n, p in engine.module.named_parameters() if p is param), None)


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
