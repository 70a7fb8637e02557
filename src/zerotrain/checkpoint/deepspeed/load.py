"""Load a DeepSpeed ZeRO checkpoint into a running zerotrain job, at any world size and stage.

Order (all ranks call it; the same as ``checkpoint/load.py``):
1. open the tag (every file, memory-mapped, through the restricted unpickler) and check the
   model's names and shapes: local work, so a bad checkpoint raises on every rank before
   any collective;
2. for every shard record of this rank, copy its element ranges of the fp32 masters and of
   Adam's moments out of DeepSpeed's partitions (``layout.py``, Note: DeepSpeed's
   partitions); frozen parameters and buffers from the model-states file;
3. one scalar all-reduce: if any rank failed, every rank raises;
4. ``stage.publish_parameters()`` (collective) writes the masters into the module;
5. hyperparameters, loss scaler, scheduler; the counters go back to the engine.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from ...records import FROZEN
from ..match import model_shapes
from ..manifest import CheckpointError
from ..reshard import target_range
from ..state import CheckpointReport, LoadResult, TrainingState, shard_rank
from .source import DeepSpeedCheckpoint

logger = logging.getLogger(__name__)


def load_deepspeed_checkpoint(state: TrainingState, path: str, *,
                              load_optimizer_states: bool = True,
                              load_lr_scheduler_states: bool = True,
                              load_module_only: bool = False) -> LoadResult:
    """Load DeepSpeed tag directory ``path`` into ``state``. Collective."""
    start = time.perf_counter()
    ckpt = DeepSpeedCheckpoint(path)
    records = state.stage.shard_records() + state.stage.frozen_records()
    check_model(ckpt, state.module, records)
    with_optimizer = load_optimizer_states and not load_module_only
    if with_optimizer:
        _check_optimizer(ckpt, state, records)
    failure: Optional[BaseException] = None
    elements = 0
    try:
        for record in records:
            elements += _load_record(state, ckpt, record, with_optimizer=(
                with_optimizer and record.group_index != FROZEN))
        elements += _load_module_tensors(state.module, ckpt, records)
    except Exception as exc:  # noqa: BLE001 - re-raised after every rank agrees
        failure = exc
    _agree(state, failure, path)
    state.stage.publish_parameters()
    counters = None
    if not load_module_only:
        _restore_small(state, ckpt, with_optimizer=with_optimizer,
                       with_scheduler=load_lr_scheduler_states)
        counters = ckpt.counters()
    report = CheckpointReport(path=path, seconds=time.perf_counter() - start,
                              elements_read=elements, bytes_read=4 * elements,
                              files_opened=len(ckpt.optim_files) + 1)
    logger.info("loaded DeepSpeed ZeRO-%d checkpoint %s (saved at world size %d) in %.3f s",
                ckpt.stage, path, ckpt.world, report.seconds)
    return LoadResult(path, ckpt.client_state(), counters, report)


def check_model(ckpt: DeepSpeedCheckpoint, module: torch.nn.Module, records) -> None:
    """Raise CheckpointError naming the first parameter or buffer that does not match."""
    params, buffers = model_shapes(module, records)
    saved_params = {n: ckpt.full_shape(n) for n in ckpt.trainable_names() + ckpt.frozen_names()}
    saved_buffers = {n: ckpt.full_shape(n) for n in ckpt.buffer_names()}
    aliases = ckpt.shared_params()
    for kind, model, saved in (("parameter", params, saved_params),
                               ("buffer", buffers, saved_buffers)):
        for name, shape in model.items():
            if name not in saved:
                raise CheckpointError(f"{kind} {name!r} of the model is missing from "
                                      f"DeepSpeed checkpoint {ckpt.path}")
            if tuple(saved[name]) != tuple(shape):
                raise CheckpointError(f"{kind} {name!r} has shape {tuple(shape)} in the model "
                                      f"but {tuple(saved[name])} in {ckpt.path}")
        for name in saved:
            if name not in model and name not in aliases:
                raise CheckpointError(f"DeepSpeed checkpoint {ckpt.path} has {kind} {name!r}, "
                                      "which the model does not have")


def _check_optimizer(ckpt: DeepSpeedCheckpoint, state: TrainingState, records) -> None:
    if not ckpt.has_optimizer:
        raise CheckpointError(f"{ckpt.path} has no zero_pp_rank_*_optim_states.pt files; "
                              "load with load_optimizer_states=False to take the weights only")
    groups = ckpt.param_groups()
    if groups and len(groups) != len(state.optimizer.param_groups):
        raise CheckpointError(f"DeepSpeed checkpoint {ckpt.path} has {len(groups)} optimizer "
                              f"parameter groups, this optimizer has "
                              f"{len(state.optimizer.param_groups)}; load with "
                              "load_optimizer_states=False to take only the weights")
    for record in records:
        for name in record.names:
            source = ckpt.params.get(name)
            if record.group_index != FROZEN and source is not None \
                    and groups and source.group != record.group_index:
                raise CheckpointError(f"parameter {name!r} is in optimizer group "
                                      f"{source.group} of {ckpt.path} but in group "
                                      f"{record.group_index} here")


def _load_record(state: TrainingState, ckpt: DeepSpeedCheckpoint, record, *,
                 with_optimizer: bool) -> int:
    """This rank's master shard and, with the optimizer, fresh Adam state. Elements read."""
    rank = shard_rank(record.layout, state.comm)
    keys, step = _state_spec(ckpt, record.names) if with_optimizer else ([], None)
    fresh = {key: _target(record.optimizer_state.get(key), record.master) for key in keys}
    elements = 0
    for key, out in [("master", record.master), *fresh.items()]:
        for slot, name in zip(record.layout.slots, record.names):
            begin, end = target_range(record.layout, slot, rank)
            at = record.layout.shard_slice(slot).start
            ckpt.read_into(name, key, begin, end, out[at: at + end - begin])
            elements += end - begin
    if not with_optimizer:
        return elements
    group = state.optimizer.param_groups[record.group_index]
    live = record.optimizer_state
    live.clear()
    live.update(fresh)
    if step is not None and fresh:
        live["step"] = _step_value(step, group, record.master)
    state.optimizer.state[record.master] = live
    return elements


def _state_spec(ckpt: DeepSpeedCheckpoint, names) -> tuple[list[str], Optional[float]]:
    found = [ckpt.state_keys(n) for n in names if n in ckpt.params]
    if not found:
        return [], None
    for other in found[1:]:
        if other != found[0]:
            raise CheckpointError(f"parameters {list(names)} come from DeepSpeed optimizer "
                                  f"states that differ ({found[0]} vs {other}); cannot merge "
                                  "them into one shard")
    return found[0]


def _target(live: Any, master: torch.Tensor) -> torch.Tensor:
    """The live state tensor when it fits (offloaded state stays where it is), else new."""
    if (isinstance(live, torch.Tensor) and live.shape == master.shape
            and live.dtype == master.dtype and live.device == master.device):
        return live.zero_()
    return torch.zeros_like(master)


def _step_value(step: float, group: dict, master: torch.Tensor) -> torch.Tensor:
    """Adam's ``step`` as torch keeps it: a float32 0-d tensor, on the parameter's device for
    fused or capturable optimizers."""
    on_device = bool(group.get("fused")) or bool(group.get("capturable"))
    return torch.tensor(step, dtype=torch.float32,
                        device=master.device if on_device else torch.device("cpu"))


def _load_module_tensors(module: torch.nn.Module, ckpt: DeepSpeedCheckpoint, records) -> int:
    """Frozen parameters and persistent buffers, cast to the module's dtypes."""
    in_records = {name for record in records for name in record.names}
    persistent = set(module.state_dict().keys())
    targets = [(n, p) for n, p in module.named_parameters() if n not in in_records]
    targets += [(n, b) for n, b in module.named_buffers() if n in persistent]
    elements = 0
    for name, target in targets:
        if name in ckpt.params:     # trainable when saved, frozen now: its master
            value = torch.empty(target.numel(), dtype=torch.float32)
            ckpt.read_into(name, "master", 0, target.numel(), value)
        else:
            value = ckpt.module_tensor(name)
        if value.is_floating_point() != target.is_floating_point():
            raise CheckpointError(f"{name!r} is {value.dtype} in {ckpt.path} but "
                                  f"{target.dtype} in the model")
        with torch.no_grad():
            target.copy_(value.reshape(target.shape))
        elements += target.numel()
    return elements


def _agree(state: TrainingState, failure: Optional[BaseException], path: str) -> None:
    """One scalar all-reduce (min over ranks of the first failing rank): all raise or none."""
    comm = state.comm
    first = 0 if failure else 1
    if comm.world_size > 1:
        flag = torch.tensor([comm.rank if failure else comm.world_size], device=comm.device)
        comm.all_reduce(flag, op="min")
        first = int(flag.item())
    if failure is not None:
        raise failure
    if first < comm.world_size:
        raise CheckpointError(f"rank {first} could not read DeepSpeed checkpoint {path} (its "
                              "error is in its log); the model was not updated")


def _restore_small(state: TrainingState, ckpt: DeepSpeedCheckpoint, *, with_optimizer: bool,
                   with_scheduler: bool) -> None:
    if with_optimizer:
        for group, saved in zip(state.optimizer.param_groups, ckpt.hyperparameters()):
            for key, value in saved.items():
                if key in group:
                    group[key] = _like(group[key], value)
        scaler = ckpt.loss_scaler_state()
        if state.loss_scaler is not None and scaler is not None:
            state.loss_scaler.load_state_dict(scaler)
    scheduler, saved = state.lr_scheduler, ckpt.lr_scheduler_state()
    if with_scheduler and scheduler is not None and saved is not None:
        scheduler.load_state_dict(saved)


def _like(current: Any, value: Any) -> Any:
    """A saved hyperparameter in the form the optimizer holds it (tuple betas, tensor lr)."""
    if isinstance(current, torch.Tensor):
        return current.copy_(torch.as_tensor(value, dtype=current.dtype))
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.tolist())
    if isinstance(current, tuple) and isinstance(value, (list, tuple)):
        return tuple(value)
    return value
