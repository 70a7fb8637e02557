"""The one load sequence every checkpoint format goes through, over a :class:`LoadSource`.

Note: stage, agree, commit
    A load changes nothing until every rank has read and checked everything:
    1. stage (local, changes nothing): the source checks the model's names and shapes and
       the optimizer's groups; this rank's element ranges of the master shards and optimizer
       state (``reshard.py``, Note: element ranges), frozen parameters and buffers are read
       into new tensors; the random-generator state, hyperparameters, scheduler,
       loss-scaler and data-loader state and the counters are checked against what will
       receive them (Note "small state is checked at staging" in ``match.py``);
    2. agree: one small all-reduce; if any rank failed, every rank raises (and all agree on
       whether there was a checkpoint at all, and that they staged the same save);
    3. commit: copy the new values into the live tensors, install the optimizer state, the
       small state and the generators, then ``stage.publish_parameters()`` (collective).
    So a load that raises leaves every tensor, hyperparameter, counter and generator as it
    was. Staging holds a host copy of this rank's master shard and optimizer state until
    commit.

The formats differ only in how they read: zerotrain's own files (``load.py``), DeepSpeed
ZeRO tags, DeepSpeed Universal folders and torch DCP folders (``deepspeed/load.py``).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from ..core.flat import FlatLayout
from ..core.records import FROZEN
from . import rng
from .load_agreement import agree
from .manifest import MALFORMED, CheckpointError
from .match import (check_counters, check_data_loader, check_group_values, check_loss_scaler,
                    check_scheduler)
from .reshard import target_range
from .state import CheckpointReport, LoadResult, TrainingState, shard_rank

logger = logging.getLogger(__name__)

class LoadSource(Protocol):
    """What a checkpoint format provides to the load sequence; every method only reads.

    ``groups_where`` and ``state_where`` are how errors name where the optimizer's groups
    and the rest of the small state were read (``scalars_where``, where a source has it,
    the optimizer's scalars such as ``step``; else ``groups_where``). The small-state methods return what was
    saved, unchecked (None: nothing saved); the sequence checks it."""

    path: str
    groups_where: str
    state_where: str

    def validate(self, module: torch.nn.Module, records: list,
                 param_groups: Optional[list]) -> None:
        """Raise unless the model's parameters and buffers match by name and shape (and,
        given the optimizer's ``param_groups``, its groups)."""

    def read_range(self, name: str, key: str, start: int, end: int,
                   out: torch.Tensor) -> None:
        """Elements ``[start, end)`` of parameter ``name``'s ``key`` (``master``,
        ``exp_avg``, ...) into the 1-D ``out``."""

    def read_same_shard(self, names: list, layout: FlatLayout, key: str, rank: int,
                        out: torch.Tensor) -> bool:
        """Read a whole shard saved with exactly this layout; False when there is none."""

    def optimizer_state_spec(self, names: list) -> tuple[list, dict]:
        """(state tensor keys, {scalar key: (value, torch dtype, or None for a Python
        value)}) of the optimizer state saved for these parameters."""

    def saved_module_tensor(self, name: str) -> Optional[torch.Tensor]:
        """A frozen parameter or buffer; None when it was trainable when saved (then its
        master is read)."""

    def left_out(self) -> frozenset:
        """Frozen parameters the save left out on purpose, known after ``validate``: the
        load keeps them as the model holds them (Note "frozen parameters left out" in
        ``save.py``)."""

    def rng_state(self, comm) -> Optional[tuple]:
        """This rank's generator state, checked; None to keep the live one."""

    def client_state(self) -> Any: ...
    def saved_param_groups(self, live_groups: list) -> list: ...
    def loss_scaler_state(self) -> Any: ...
    def lr_scheduler_state(self) -> Any: ...
    def data_loader_state(self) -> Any: ...
    def counters(self) -> dict: ...

    def identity(self) -> int:
        """A hash of this save: ranks that read two saves of one tag differ here."""

    def report(self) -> CheckpointReport: ...

    def malformed(self, exc: Exception) -> Exception:
        """What a read that failed with one of :data:`MALFORMED` raises."""

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """``optimizer``: optimizer state and hyperparameters; ``small``: the rest of the small
    state (counters, loss scaler, data loader, generators); ``scheduler``: the LR
    scheduler's state (with ``small``)."""

    optimizer: bool
    small: bool
    scheduler: bool


@dataclass(slots=True)
class Staged:
    """Everything a load will write, read and checked but not yet applied.

    ``tensors`` pairs each live tensor (a master shard, a frozen parameter, a buffer) with
    its new value; ``states`` gives each record its new optimizer-state dict and the
    (target, value) copies into it, not yet visible to the optimizer."""

    path: str
    identity: int
    report: CheckpointReport = field(default_factory=CheckpointReport)
    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    states: list[tuple[Any, dict, list]] = field(default_factory=list)
    rng: Optional[tuple] = None
    client_state: Any = None
    param_groups: Optional[list] = None
    loss_scaler: Optional[dict] = None
    lr_scheduler: Optional[dict] = None
    data_loader: Optional[dict] = None
    counters: Optional[dict] = None


def load_staged(state: TrainingState, locate: Callable[[], Optional[str]],
                open_source: Callable[[str], LoadSource], *, what: str, where: str,
                options: LoadOptions) -> LoadResult:
    """Stage, agree, commit (the Note). Collective: every rank calls it. ``locate()`` gives
    the checkpoint's path, or None when there is none (``LoadResult(None, None)``);
    ``what`` names the format in errors ("DeepSpeed checkpoint"), ``where`` the place
    looked in when there is no path."""
    start = time.perf_counter()
    path: Optional[str] = None
    staged: Optional[Staged] = None
    failure: Optional[Exception] = None
    try:
        path = locate()
        if path is not None:
            staged = _stage(state, open_source(path), options)
    except Exception as exc:  # noqa: BLE001 - re-raised after every rank agrees
        failure = exc
    agree(state.comm, failure, found=path is not None, what=what, where=path or where,
          identity=staged.identity if staged is not None else 0)
    if staged is None:
        return LoadResult(None, None)
    _commit(state, staged)
    staged.report.seconds = time.perf_counter() - start
    logger.info("loaded %s %s in %.3f s (%d bytes read on this rank)", what, staged.path,
                staged.report.seconds, staged.report.bytes_read)
    return LoadResult(staged.path, staged.client_state, staged.counters, staged.report)


def _stage(state: TrainingState, source: LoadSource, options: LoadOptions) -> Staged:
    """Read and check everything this rank will load, changing nothing."""
    try:
        return _stage_from(state, source, options)
    except CheckpointError:
        raise
    except MALFORMED as exc:
        raise source.malformed(exc) from None
    finally:
        source.close()


def _stage_from(state: TrainingState, source: LoadSource, options: LoadOptions) -> Staged:
    records = state.stage.shard_records() + state.stage.frozen_records()
    groups = state.optimizer.param_groups
    source.validate(state.module, records, groups if options.optimizer else None)
    staged = Staged(path=source.path, identity=source.identity())
    kept = source.left_out()
    for record in records:
        _stage_record(state, source, record, staged, kept, with_optimizer=(
            options.optimizer and record.group_index != FROZEN))
    staged.tensors += _stage_module_tensors(state.module, source, records, kept)
    staged.report = source.report()   # shards only: generator state is not counted
    if options.small:
        staged.rng = source.rng_state(state.comm)
    staged.report.files_opened = source.report().files_opened
    staged.client_state = source.client_state()
    if options.small:
        _stage_small(state, source, staged, options)
    return staged


def _stage_record(state: TrainingState, source: LoadSource, record, staged: Staged,
                  kept: frozenset, *, with_optimizer: bool) -> None:
    """Read this rank's master shard and, with the optimizer, its state into new tensors
    (the padding of the master, and the chunks of parameters in ``kept``, as they are)."""
    rank = shard_rank(record.layout, state.comm)
    keys, scalars = source.optimizer_state_spec(record.names) if with_optimizer else ([], {})
    # fp32 like the file, whatever the master's dtype (Note "bf16 masters in checkpoints"
    # in save.py): the commit's copy rounds it into a bf16 master
    master = record.master.detach().to("cpu", dtype=torch.float32, copy=True)
    values = {key: torch.zeros(record.master.shape, dtype=torch.float32) for key in keys}
    for key, out in [("master", master), *values.items()]:
        if source.read_same_shard(list(record.names), record.layout, key, rank, out):
            continue
        for slot, name in zip(record.layout.slots, record.names):
            if name in kept:   # a frozen shard record's (stage 3): the model's value stays
                continue
            begin, end = target_range(record.layout, slot, rank)
            at = record.layout.shard_slice(slot).start
            source.read_range(name, key, begin, end, out[at: at + end - begin])
    staged.tensors.append((record.master, master))
    if not with_optimizer:
        return
    group = state.optimizer.param_groups[record.group_index]
    fresh: dict[str, Any] = {}
    copies = []
    for key, value in values.items():
        fresh[key] = state_target(record.optimizer_state.get(key), record.master)
        copies.append((fresh[key], value))
    where = getattr(source, "scalars_where", source.groups_where)
    for key, (value, dtype) in scalars.items():
        check_count_scalar(key, value, record.names, where)
        fresh[key] = value if dtype is None else _scalar(value, dtype, group, record.master)
    staged.states.append((record, fresh, copies))


COUNT_SCALARS = ("step",)   # optimizer scalars that count updates (Adam's bias correction)
_MAX_COUNT = 2 ** 62


def check_count_scalar(key: str, value: Any, names: Sequence[str], where: str) -> None:
    """An optimizer scalar that counts updates (Adam's ``step``) must be a non-negative
    integral number: -1 divides by zero in the next bias correction, -0.9 silently scales
    the next update several times over, 2.5 resumes a schedule that never existed. Raises
    CheckpointError naming ``where`` (the file) and the field."""
    if key not in COUNT_SCALARS or value is None:
        return
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    ok = (isinstance(number, (int, float)) and not isinstance(number, bool)
          and math.isfinite(number) and float(number).is_integer()
          and 0 <= number < _MAX_COUNT)
    if not ok:
        first = f"{names[0]!r}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
        raise CheckpointError(f"{where}: optimizer state {key!r} of parameter {first} is "
                              f"{number!r}; expected a non-negative integer (a count of "
                              "optimizer steps)")


def _scalar(value: Any, dtype: torch.dtype, group: dict, master: torch.Tensor) -> Any:
    """A scalar optimizer state such as Adam's ``step``: a 0-d tensor where torch keeps one
    (on the parameter's device for fused/capturable optimizers, else on the CPU)."""
    on_device = bool(group.get("fused")) or bool(group.get("capturable"))
    try:
        return torch.tensor(value, dtype=dtype,
                            device=master.device if on_device else torch.device("cpu"))
    except (RuntimeError, TypeError, OverflowError) as exc:
        raise CheckpointError(f"optimizer scalar {value!r} does not fit {dtype}: "
                              f"{exc}") from None


def _stage_module_tensors(module: torch.nn.Module, source: LoadSource, records,
                          kept: frozenset) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, new value) for frozen parameters (but those ``kept``) and persistent
    buffers, cast on commit."""
    in_records = {name for record in records for name in record.names}
    persistent = set(module.state_dict(keep_vars=True).keys())
    targets = [(n, p) for n, p in module.named_parameters()
               if n not in in_records and n not in kept]
    targets += [(n, b) for n, b in module.named_buffers() if n in persistent]
    out = []
    for name, target in targets:
        value = source.saved_module_tensor(name)
        if value is None:   # trainable when saved, frozen now: rebuild it from its master
            value = torch.empty(target.numel(), dtype=torch.float32)
            source.read_range(name, "master", 0, target.numel(), value)
        if value.is_floating_point() != target.is_floating_point():
            raise CheckpointError(f"{name!r} is {value.dtype} in {source.path} but "
                                  f"{target.dtype} in the model")
        if value.numel() != target.numel():
            raise CheckpointError(f"{name!r} has {value.numel()} elements in {source.path} "
                                  f"but {target.numel()} in the model")
        out.append((target, value.reshape(target.shape)))
    return out


def _stage_small(state: TrainingState, source: LoadSource, staged: Staged,
                 options: LoadOptions) -> None:
    """The small state to restore, each piece checked against what will receive it."""
    where = source.state_where
    if options.optimizer:
        groups = state.optimizer.param_groups
        staged.param_groups = check_group_values(source.saved_param_groups(groups), groups,
                                                 source.groups_where)
        scaler = source.loss_scaler_state() if state.loss_scaler is not None else None
        if scaler is not None:
            staged.loss_scaler = check_loss_scaler(scaler, state.loss_scaler.state_dict(),
                                                   where)
            _accepted(state.loss_scaler, staged.loss_scaler, "loss_scaler", where)
    if options.scheduler and state.lr_scheduler is not None:
        saved = source.lr_scheduler_state()
        if saved is not None:
            staged.lr_scheduler = check_scheduler(saved, state.lr_scheduler.state_dict(),
                                                  where)
            _accepted(state.lr_scheduler, staged.lr_scheduler, "lr_scheduler", where)
    loader, position = state.data_loader, source.data_loader_state()
    if loader is not None and position is not None and hasattr(loader, "load_state_dict"):
        if hasattr(loader, "state_dict"):
            position = check_data_loader(position, loader.state_dict(), where)
        _accepted(loader, position, "data_loader", where)
        staged.data_loader = position
    staged.counters = check_counters(source.counters(), where)


def _accepted(owner: Any, value: Any, what: str, where: str) -> None:
    """Ask ``owner`` whether its ``load_state_dict(value)`` would raise, where it can say
    without loading (``check_state_dict``: zerotrain's schedules): a refusal at commit would
    come after the weights and the optimizer state were written (Note: stage, agree,
    commit)."""
    check = getattr(owner, "check_state_dict", None)
    if not callable(check):
        return
    try:
        check(value)
    except (ValueError, TypeError, KeyError) as exc:
        key = str(getattr(exc, "path", "")).rsplit(".", 1)[-1]   # a ConfigError's key
        if isinstance(value, dict) and key in value:
            raise CheckpointError(f"{where}: {what}[{key!r}] is {value[key]!r}; "
                                  f"{type(owner).__name__} refuses it: "
                                  f"{getattr(exc, 'message', exc)}") from None
        raise CheckpointError(f"{where}: {what} is refused by {type(owner).__name__}: "
                              f"{exc}") from None


def _commit(state: TrainingState, staged: Staged) -> None:
    """Apply what :func:`_stage` read: copies and assignments that cannot fail, then the
    collective that makes the module follow the masters."""
    commit_tensors(state, staged.tensors, staged.states)
    if staged.param_groups is not None:
        for group, saved in zip(state.optimizer.param_groups, staged.param_groups):
            for key, value in saved.items():
                group[key] = _like(group.get(key), value)
    for owner, value in ((state.loss_scaler, staged.loss_scaler),
                         (state.lr_scheduler, staged.lr_scheduler),
                         (state.data_loader, staged.data_loader)):
        if value is not None:
            owner.load_state_dict(value)
    if staged.rng is not None:
        rng.restore(*staged.rng)
    state.stage.publish_parameters()


def _like(current: Any, value: Any) -> Any:
    """A saved hyperparameter in the form the optimizer holds it (tuple betas, tensor lr)."""
    if isinstance(current, torch.Tensor):
        return current.copy_(torch.as_tensor(value, dtype=current.dtype))
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.tolist())
    if isinstance(current, tuple) and isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def state_target(live: Any, master: torch.Tensor) -> torch.Tensor:
    """Where a state tensor will live: the live one when it fits (offloaded state stays in
    its host or NVMe storage; written only on commit), else a new one like the master."""
    if (isinstance(live, torch.Tensor) and live.shape == master.shape
            and live.dtype == master.dtype and live.device == master.device):
        return live
    return torch.zeros_like(master)


def commit_tensors(state: TrainingState, tensors: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   states: Sequence[tuple[Any, dict, list]]) -> None:
    """Copy each staged value into its live tensor; give each record its new optimizer
    state (``states``: record, its new state dict, (target, value) copies into it)."""
    with torch.no_grad():
        for target, value in tensors:
            target.copy_(value)
    for record, fresh, copies in states:
        for target, value in copies:
            target.copy_(value)
        live = record.optimizer_state
        live.clear()
        live.update(fresh)
        state.optimizer.state[record.master] = live
