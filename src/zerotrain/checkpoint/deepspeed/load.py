"""Load a DeepSpeed ZeRO checkpoint into a running zerotrain job, at any world size and stage.

Order (all ranks call it; Note "stage, agree, commit" in ``checkpoint/load.py``):
1. open the tag (every file, memory-mapped, through the restricted unpickler) and check the
   model's names and shapes;
2. stage: for every shard record of this rank, read its element ranges of the fp32 masters
   and of Adam's moments out of DeepSpeed's partitions (``layout.py``, Note: DeepSpeed's
   partitions) into new tensors; frozen parameters and buffers from the model-states
   file; hyperparameters, loss scaler and scheduler state, counters and client state;
   nothing of the training state changes;
3. one scalar all-reduce: if any rank failed, every rank raises, the state as it was;
4. commit: copies and assignments that cannot fail, then ``stage.publish_parameters()``
   (collective) writes the masters into the module.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ...core.records import FROZEN
from ..match import (check_counters, check_group_values, check_loss_scaler, check_scheduler,
                     json_group_values, model_shapes)
from ..manifest import CheckpointError
from ..reshard import target_range
from ..staging import commit_tensors, state_target
from ..state import CheckpointReport, LoadResult, TrainingState, shard_rank
from .source import DeepSpeedCheckpoint, malformed

logger = logging.getLogger(__name__)


def load_deepspeed_checkpoint(state: TrainingState, path: str, *,
                              load_optimizer_states: bool = True,
                              load_lr_scheduler_states: bool = True,
                              load_module_only: bool = False,
                              source: Optional[Callable[[str], Any]] = None) -> LoadResult:
    """Load DeepSpeed tag directory ``path`` into ``state``. Collective; a load that raises
    leaves every tensor, hyperparameter and counter as it was. ``source(path)`` opens another
    format with :class:`DeepSpeedCheckpoint`'s reading methods (DCP, Universal)."""
    start = time.perf_counter()
    with_optimizer = load_optimizer_states and not load_module_only
    staged: Optional[_Staged] = None
    failure: Optional[BaseException] = None
    try:
        staged = _stage(state, path, with_optimizer=with_optimizer,
                        with_small=not load_module_only,
                        with_scheduler=load_lr_scheduler_states, source=source)
    except Exception as exc:  # noqa: BLE001 - re-raised after every rank agrees
        failure = exc
    _agree(state, failure, path, identity=staged.identity if staged is not None else 0)
    assert staged is not None
    _commit(state, staged)
    state.stage.publish_parameters()
    report = CheckpointReport(path=path, seconds=time.perf_counter() - start,
                              elements_read=staged.elements, bytes_read=4 * staged.elements,
                              files_opened=staged.files_opened)
    logger.info("loaded %s checkpoint %s (saved at world size %d) in %.3f s",
                staged.what or f"DeepSpeed ZeRO-{staged.stage}", path, staged.world,
                report.seconds)
    return LoadResult(path, staged.client_state, staged.counters, report)


@dataclass(slots=True)
class _Staged:
    """What a load will write, read and checked but not yet applied: (live tensor, new
    value) pairs, each record's new optimizer state, the small state."""

    stage: int
    world: int
    files_opened: int
    elements: int = 0
    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    states: list[tuple[Any, dict, list]] = field(default_factory=list)
    hyperparameters: Optional[list] = None
    scaler: Optional[dict] = None
    scheduler: Optional[dict] = None
    counters: Optional[dict] = None
    client_state: Any = None
    identity: int = 0
    what: str = ""


def _stage(state: TrainingState, path: str, **kwargs: Any) -> _Staged:
    """Read and check everything this rank will load, changing nothing; a field of the wrong
    type or size anywhere becomes a CheckpointError naming the tag."""
    try:
        return _stage_checked(state, path, **kwargs)
    except CheckpointError:
        raise
    except (ValueError, TypeError, RuntimeError, RecursionError, KeyError, IndexError,
            AttributeError, OverflowError) as exc:
        raise malformed(path, exc) from None


def _stage_checked(state: TrainingState, path: str, *, with_optimizer: bool,
                   with_small: bool, with_scheduler: bool,
                   source: Optional[Callable[[str], Any]] = None) -> _Staged:
    ckpt = DeepSpeedCheckpoint(path) if source is None else source(path)
    records = state.stage.shard_records() + state.stage.frozen_records()
    check_model(ckpt, state.module, records)
    if with_optimizer:
        _check_optimizer(ckpt, state, records)
    staged = _Staged(stage=ckpt.stage, world=ckpt.world, files_opened=len(ckpt.optim_files) + 1,
                     identity=ckpt.identity(), what=getattr(ckpt, "what", ""))
    for record in records:
        _stage_record(state, ckpt, record, staged, with_optimizer=(
            with_optimizer and record.group_index != FROZEN))
    staged.tensors += _stage_module_tensors(state.module, ckpt, records, staged)
    staged.client_state = ckpt.client_state()
    if with_small:   # every part checked here, before any rank commits (match.py)
        if with_optimizer:
            staged.hyperparameters = _staged_hyperparameters(state, ckpt)
            scaler = ckpt.loss_scaler_state() if state.loss_scaler is not None else None
            if scaler is not None:
                staged.scaler = check_loss_scaler(scaler, state.loss_scaler.state_dict(),
                                                  ckpt.model_file)
        if with_scheduler and state.lr_scheduler is not None:
            saved = ckpt.model.get("lr_scheduler")
            if saved is not None:
                staged.scheduler = check_scheduler(saved, state.lr_scheduler.state_dict(),
                                                   ckpt.model_file)
        staged.counters = check_counters(ckpt.counters(), ckpt.model_file)
    return staged


def _commit(state: TrainingState, staged: _Staged) -> None:
    """Apply what :func:`_stage` read."""
    commit_tensors(state, staged.tensors, staged.states)
    if staged.hyperparameters is not None:
        for group, saved in zip(state.optimizer.param_groups, staged.hyperparameters):
            for key, value in saved.items():
                group[key] = _like(group[key], value)
    if staged.scaler is not None:
        state.loss_scaler.load_state_dict(staged.scaler)
    if staged.scheduler is not None:
        state.lr_scheduler.load_state_dict(staged.scheduler)


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


def _stage_record(state: TrainingState, ckpt: DeepSpeedCheckpoint, record, staged: _Staged,
                  *, with_optimizer: bool) -> None:
    """Read this rank's master shard and, with the optimizer, its Adam state into new
    tensors (the padding of the master kept as it is)."""
    rank = shard_rank(record.layout, state.comm)
    keys, step = _state_spec(ckpt, record.names) if with_optimizer else ([], None)
    master = record.master.detach().to("cpu", copy=True)
    values = {key: torch.zeros(record.master.shape, dtype=torch.float32) for key in keys}
    for key, out in [("master", master), *values.items()]:
        for slot, name in zip(record.layout.slots, record.names):
            begin, end = target_range(record.layout, slot, rank)
            at = record.layout.shard_slice(slot).start
            ckpt.read_into(name, key, begin, end, out[at: at + end - begin])
            staged.elements += end - begin
    staged.tensors.append((record.master, master))
    if not with_optimizer:
        return
    group = state.optimizer.param_groups[record.group_index]
    fresh: dict[str, Any] = {}
    copies = []
    for key, value in values.items():
        fresh[key] = state_target(record.optimizer_state.get(key), record.master)
        copies.append((fresh[key], value))
    if step is not None and fresh:
        fresh["step"] = _step_value(step, group, record.master)
    staged.states.append((record, fresh, copies))


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


def _step_value(step: float, group: dict, master: torch.Tensor) -> torch.Tensor:
    """Adam's ``step`` as torch keeps it: a float32 0-d tensor, on the parameter's device for
    fused or capturable optimizers."""
    on_device = bool(group.get("fused")) or bool(group.get("capturable"))
    return torch.tensor(step, dtype=torch.float32,
                        device=master.device if on_device else torch.device("cpu"))


def _stage_module_tensors(module: torch.nn.Module, ckpt: DeepSpeedCheckpoint, records,
                          staged: _Staged) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, new value) for frozen parameters and persistent buffers, cast on commit."""
    in_records = {name for record in records for name in record.names}
    persistent = set(module.state_dict(keep_vars=True).keys())
    targets = [(n, p) for n, p in module.named_parameters() if n not in in_records]
    targets += [(n, b) for n, b in module.named_buffers() if n in persistent]
    out = []
    for name, target in targets:
        if name in ckpt.params:     # trainable when saved, frozen now: its master
            value = torch.empty(target.numel(), dtype=torch.float32)
            ckpt.read_into(name, "master", 0, target.numel(), value)
        else:
            value = ckpt.module_tensor(name)
        if value.is_floating_point() != target.is_floating_point():
            raise CheckpointError(f"{name!r} is {value.dtype} in {ckpt.path} but "
                                  f"{target.dtype} in the model")
        if value.numel() != target.numel():
            raise CheckpointError(f"{name!r} has {value.numel()} elements in {ckpt.path} "
                                  f"but {target.numel()} in the model")
        out.append((target, value.reshape(target.shape)))
        staged.elements += target.numel()
    return out


def _agree(state: TrainingState, failure: Optional[BaseException], path: str, *,
           identity: int) -> None:
    """One all-reduce (min over ranks of the first failing rank, the save identity and its
    negation): all raise or none, and all staged the same save."""
    comm = state.comm
    first, same = (0 if failure else 1), True
    if comm.world_size > 1:
        flag = torch.tensor([comm.rank if failure else comm.world_size, identity, -identity],
                            dtype=torch.int64, device=comm.device)
        comm.all_reduce(flag, op="min")
        first, same = int(flag[0]), int(flag[1]) == -int(flag[2])
    if failure is not None:
        raise failure
    if first < comm.world_size:
        raise CheckpointError(f"rank {first} could not read DeepSpeed checkpoint {path} (its "
                              "error is in its log); the model was not updated")
    if not same:
        raise CheckpointError(f"ranks read different saves of DeepSpeed checkpoint {path} "
                              "(it was saved again while they loaded it); the model was not "
                              "updated")


def _staged_hyperparameters(state: TrainingState, ckpt: DeepSpeedCheckpoint) -> list[dict]:
    """Each group's saved hyperparameters that the live group has, through the check the
    zerotrain format's pass (``match.check_group_values``: kinds, finite, ranges)."""
    groups = state.optimizer.param_groups
    saved = [{k: v for k, v in g.items() if k in live}
             for g, live in zip(json_group_values(ckpt.hyperparameters()), groups)]
    return check_group_values(saved, groups, ckpt.optim_files[0])


def _like(current: Any, value: Any) -> Any:
    """A saved hyperparameter in the form the optimizer holds it (tuple betas, tensor lr)."""
    if isinstance(current, torch.Tensor):
        return current.copy_(torch.as_tensor(value, dtype=current.dtype))
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.tolist())
    if isinstance(current, tuple) and isinstance(value, (list, tuple)):
        return tuple(value)
    return value
