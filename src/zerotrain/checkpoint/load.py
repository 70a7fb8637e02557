"""``load_checkpoint``: read exactly this rank's element ranges, then publish.

Note: stage, agree, commit
    A load changes nothing until every rank has read and checked everything:
    1. stage (local, changes nothing): resolve the tag (``latest`` by default); validate the
       manifest, the files' sizes, the model's names and shapes and the optimizer's groups;
       read this rank's master shards and optimizer state (``reshard.py``, Note: element
       ranges), frozen parameters and buffers into new tensors; check the random-generator
       state on scratch generators and the hyperparameters, scheduler, loss-scaler and
       data-loader state against what will receive them;
    2. agree: one small all-reduce; if any rank failed, every rank raises (and all agree on
       whether there was a checkpoint at all);
    3. commit: copy the new values into the live tensors, install the optimizer state,
       ``stage.publish_parameters()`` (collective), then the JSON state and the generators.
    So a load that raises leaves every tensor, hyperparameter and generator as it was.
    Staging holds a host copy of this rank's master shard and optimizer state until commit.

Nothing is unpickled: tensors come from ``safetensors.safe_open``, the rest from JSON.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..core.records import FROZEN
from . import client_state, dcp, deepspeed, fs, rng
from .deepspeed.universal import UniversalCheckpoint, find_universal_dir
from .manifest import (LATEST_NAME, CheckpointError, check_tag, file_identity_check,
                       read_manifest, save_identity)
from .match import (check_data_loader, check_group_values, check_groups, check_loss_scaler,
                    check_model, check_scheduler)
from .reshard import SourceIndex, target_range
from .staging import commit_tensors, state_target
from .state import COUNTERS, CheckpointReport, LoadResult, TrainingState, shard_rank
from .stfile import DTYPES_BY_NAME, Reader

logger = logging.getLogger(__name__)


def load_checkpoint(state: TrainingState, load_dir: str, *, tag: Optional[str] = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> LoadResult:
    """Load checkpoint ``tag`` (default: the one ``latest`` names) from ``load_dir``.

    Collective. A missing directory or ``latest`` returns ``LoadResult(None, None)`` with a
    warning (as DeepSpeed does); a missing explicit tag raises CheckpointError. Nothing of
    the training state changes until every rank has read and checked everything (Note:
    stage, agree, commit); a load that raises leaves every tensor as it was.
    """
    dcp_path = dcp.find_dcp_dir(load_dir, tag)
    if dcp_path is not None:   # a torch DCP checkpoint (FSDP2), read by the DeepSpeed importer
        return deepspeed.load_deepspeed_checkpoint(
            state, dcp_path, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            source=lambda path: dcp.DcpCheckpoint(path, state.module))
    universal_path = find_universal_dir(load_dir, tag)
    if universal_path is not None:   # ds_to_universal output, before DeepSpeed's own tags
        return deepspeed.load_deepspeed_checkpoint(
            state, universal_path, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            source=UniversalCheckpoint)
    latest, is_deepspeed = _agreed_source(state.comm, load_dir, tag)
    if is_deepspeed:   # a DeepSpeed ZeRO checkpoint (docs/from-deepspeed.md)
        named = tag if tag is not None else latest
        return deepspeed.load_deepspeed_checkpoint(
            state, deepspeed.find_tag_dir(load_dir, named) or os.path.join(load_dir, named),
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
    start = time.perf_counter()
    with_optimizer = load_optimizer_states and not load_module_only
    path: Optional[str] = None
    staged: Optional[_Staged] = None
    failure: Optional[BaseException] = None
    try:
        if isinstance(latest, CheckpointError):
            raise latest
        path = _resolve(load_dir, tag, latest)
        if path is not None:
            staged = _stage(state, path, with_optimizer=with_optimizer,
                            with_small=not load_module_only,
                            with_scheduler=load_lr_scheduler_states)
    except Exception as exc:  # noqa: BLE001 - re-raised after every rank agrees
        failure = exc
    _agree(state.comm, failure, found=path is not None, where=path or load_dir,
           identity=_save_identity(staged))
    if staged is None:
        return LoadResult(None, None)
    _commit(state, staged)
    state.stage.publish_parameters()
    staged.report.seconds = time.perf_counter() - start
    logger.info("loaded checkpoint %s in %.3f s (%d bytes of shards read on rank 0)", path,
                staged.report.seconds, staged.report.bytes_read)
    counters = (None if load_module_only
                else {k: int(staged.manifest["counters"][k]) for k in COUNTERS})
    return LoadResult(path, staged.client_state, counters, staged.report)


@dataclass(slots=True)
class _Staged:
    """Everything a load will write, read and checked but not yet applied.

    ``tensors`` pairs each live tensor (a master shard, a frozen parameter, a buffer) with
    its new value; ``states`` gives each record's new optimizer-state dict, whose tensors
    are not yet visible to the optimizer; ``rng`` is this rank's generator state or None.
    """

    manifest: dict
    report: CheckpointReport
    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    states: list[tuple[Any, dict, list]] = field(default_factory=list)
    small: Optional[dict] = None
    rng: Optional[tuple] = None
    client_state: dict = field(default_factory=dict)


def _stage(state: TrainingState, path: str, *, with_optimizer: bool, with_small: bool,
           with_scheduler: bool) -> _Staged:
    """Read and check everything this rank will load, changing nothing (Note: stage, agree,
    commit)."""
    manifest = read_manifest(path)
    records = state.stage.shard_records() + state.stage.frozen_records()
    index = SourceIndex(manifest)
    check_model(manifest, state.module, records, path)
    if with_optimizer:
        check_groups(manifest, state.optimizer.param_groups, path)
    staged = _Staged(manifest=manifest, report=CheckpointReport(path=path))
    with Reader(path, on_open=file_identity_check(manifest, path)) as reader:
        for record in records:
            _stage_record(state, index, reader, record, staged, with_optimizer=(
                with_optimizer and record.group_index != FROZEN))
        staged.tensors += _stage_module_tensors(state.module, index, reader, records)
        staged.report = CheckpointReport(path=path, elements_read=reader.elements_read,
                                         bytes_read=reader.bytes_read)
        if with_small:
            staged.rng = _read_rng(manifest, reader, state.comm)
        staged.report.files_opened = reader.files_opened
    staged.client_state = client_state.load(manifest, path)
    if with_small:
        staged.small = _check_small(state, manifest, with_optimizer=with_optimizer,
                                    with_scheduler=with_scheduler, path=path)
    return staged


def _commit(state: TrainingState, staged: _Staged) -> None:
    """Apply what :func:`_stage` read: copies and assignments that cannot fail."""
    commit_tensors(state, staged.tensors, staged.states)
    if staged.small is not None:
        _restore_small(state, staged.small)
    if staged.rng is not None:
        rng.restore(*staged.rng)


# Note: one tag for every rank
#     ``latest`` is read once, by rank 0, and its text sent to every rank before anything is
#     staged: were each rank to read it, a save finishing in between would have rank 0 load
#     step 2 and rank 1 step 4. A tag re-saved in place between ranks' reads is caught by the
#     agreement, which compares a hash of each rank's ``save_id`` (DeepSpeed's format: of
#     its step counters and file sizes) and refuses a mix.
def _agreed_source(comm, load_dir: str, tag: Optional[str]) -> tuple[Any, bool]:
    """(the text of ``load_dir/latest`` when ``tag`` is None: None for no directory or no
    file, a CheckpointError when it cannot be read; whether the tag is DeepSpeed's), as rank
    0 found them, the same on every rank (Note: one tag for every rank)."""
    value: Any = None
    is_deepspeed = False
    if comm.rank == 0:
        try:
            if tag is None:
                value = fs.read_latest_text(load_dir) if os.path.isdir(load_dir) else None
            named = tag if tag is not None else value
            is_deepspeed = named is not None and \
                deepspeed.find_tag_dir(load_dir, named) is not None
        except CheckpointError as exc:
            value = exc
    if comm.world_size > 1:
        failed = isinstance(value, CheckpointError)
        got = comm.all_gather_object((failed, str(value) if failed else value, is_deepspeed),
                                     label="checkpoint load: which tag every rank loads")[0]
        value = CheckpointError(got[1]) if got[0] else got[1]
        is_deepspeed = got[2]
    return value, is_deepspeed


def _save_identity(staged: Optional["_Staged"]) -> int:
    if staged is None:
        return 0
    return save_identity(str(staged.manifest.get("save_id") or staged.manifest["counters"]))


def _resolve(load_dir: str, tag: Optional[str], latest: Optional[str]) -> Optional[str]:
    if tag is not None:
        found = fs.tag_dir(load_dir, tag)
        if found is None:
            raise CheckpointError(f"checkpoint tag {tag!r} was not found in {load_dir} (no "
                                  f"{os.path.join(load_dir, tag, 'manifest.json')})")
        return found
    if not os.path.isdir(load_dir):
        logger.warning("no checkpoint directory %s; nothing loaded", load_dir)
        return None
    if latest is not None:
        try:
            latest = check_tag(latest)
        except CheckpointError as exc:   # say which file named it (an empty or edited latest)
            raise CheckpointError(f"{os.path.join(load_dir, LATEST_NAME)}: {exc}") from None
    if latest is None:
        logger.warning("no 'latest' file in %s; pass tag= to load a specific checkpoint. "
                       "Nothing loaded", load_dir)
        return None
    found = fs.tag_dir(load_dir, latest)
    if found is None:
        logger.warning("'latest' in %s names %r, which does not exist; nothing loaded",
                       load_dir, latest)
    return found


# --------------------------------------------------------------------------- tensors
def _stage_record(state: TrainingState, index: SourceIndex, reader: Reader, record,
                  staged: _Staged, *, with_optimizer: bool) -> None:
    """Read this rank's master shard and, with the optimizer, its state into new tensors."""
    rank = shard_rank(record.layout, state.comm)
    same = index.same_record(list(record.names), record.layout)
    keys, scalars, nones = _state_spec(index, record.names) if with_optimizer else ([], {}, [])
    master = record.master.detach().to("cpu", copy=True)   # keeps the padding as it is
    values = {key: torch.zeros(record.master.shape, dtype=torch.float32) for key in keys}
    for key, out in [("master", master), *values.items()]:
        if same is not None:
            index.read_record_shard(reader, same, key, rank, out)
            continue
        for slot, name in zip(record.layout.slots, record.names):
            begin, end = target_range(record.layout, slot, rank)
            at = record.layout.shard_slice(slot).start
            index.read_into(reader, name, key, begin, end, out[at: at + end - begin])
    staged.tensors.append((record.master, master))
    if not with_optimizer:
        return
    group = state.optimizer.param_groups[record.group_index]
    fresh: dict[str, Any] = {}
    copies = []
    for key, value in values.items():
        fresh[key] = state_target(record.optimizer_state.get(key), record.master)
        copies.append((fresh[key], value))
    fresh.update({key: _scalar(spec, group, record.master) for key, spec in scalars.items()})
    fresh.update({key: None for key in nones})
    staged.states.append((record, fresh, copies))


def _state_spec(index: SourceIndex, names) -> tuple[list, dict, list]:
    """The optimizer-state keys of the source records these parameters come from."""
    sources = [index.params[n].record for n in names if n in index.params]
    if not sources:
        return [], {}, []
    first = sources[0]
    spec = (first["state_tensors"], first["state_scalars"], first.get("state_none", []))
    for other in sources[1:]:
        if (other["state_tensors"], other["state_scalars"]) != spec[:2]:
            raise CheckpointError(f"source records {first['key']!r} and {other['key']!r} "
                                  "have different optimizer state; cannot merge them")
    return list(spec[0]), dict(spec[1]), list(spec[2])


def _scalar(spec: dict, group: dict, master: torch.Tensor) -> Any:
    """A scalar optimizer state such as Adam's ``step``: a 0-d tensor where torch keeps one
    (on the parameter's device for fused/capturable optimizers, else on the CPU)."""
    if spec["dtype"] == "python":
        return spec["value"]
    dtype = DTYPES_BY_NAME.get(spec["dtype"])
    if dtype is None:
        raise CheckpointError(f"optimizer scalar has unsupported dtype {spec['dtype']!r}")
    on_device = bool(group.get("fused")) or bool(group.get("capturable"))
    try:
        return torch.tensor(spec["value"], dtype=dtype,
                            device=master.device if on_device else torch.device("cpu"))
    except (RuntimeError, TypeError, OverflowError) as exc:
        raise CheckpointError(f"optimizer scalar {spec['value']!r} does not fit "
                              f"{spec['dtype']}: {exc}") from None


def _stage_module_tensors(module: torch.nn.Module, index: SourceIndex, reader: Reader,
                          records) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, new value) for frozen parameters and persistent buffers, cast on commit."""
    in_records = {name for record in records for name in record.names}
    persistent = set(module.state_dict(keep_vars=True).keys())
    targets = [(n, p) for n, p in module.named_parameters() if n not in in_records]
    targets += [(n, b) for n, b in module.named_buffers() if n in persistent]
    out = []
    for name, target in targets:
        if name in index.module_entries:
            value = index.read_module(reader, name)
        else:  # trainable when saved, frozen now: rebuild it from the master shards
            value = torch.empty(target.numel(), dtype=torch.float32)
            index.read_into(reader, name, "master", 0, target.numel(), value)
        if value.is_floating_point() != target.is_floating_point():
            raise CheckpointError(f"{name!r} is {value.dtype} in the checkpoint but "
                                  f"{target.dtype} in the model")
        if value.numel() != target.numel():
            raise CheckpointError(f"{name!r} has {value.numel()} elements in the checkpoint "
                                  f"but {target.numel()} in the model")
        out.append((target, value.view(target.shape)))
    return out


def _read_rng(manifest: dict, reader: Reader, comm) -> Optional[tuple]:
    if manifest["world_size"] != comm.world_size:
        logger.info("world size changed (%d -> %d): random generators are not restored",
                    manifest["world_size"], comm.world_size)
        return None
    filename = manifest["rank_files"][comm.rank]
    handle = reader.handle(filename)
    tensors = {k: reader.read(filename, k) for k in handle.keys() if k.startswith(rng.PREFIX)}
    meta = reader.metadata(filename).get("rng")
    where = os.path.join(reader.directory, filename)
    if meta is None:
        raise CheckpointError(f"checkpoint file {where} has no random-generator state")
    try:
        rng.check(tensors, meta)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint file {where}: {exc}") from None
    return tensors, meta


def _agree(comm, failure: Optional[BaseException], *, found: bool, where: str,
           identity: int = 0) -> None:
    """One all-reduce (min of: the first failing rank, found, -found, the save identity and
    its negation): every rank raises, or none does, all agree whether there is a checkpoint
    to load, and all staged the same save (Note: one tag for every rank)."""
    same = True
    if comm.world_size > 1:
        flags = torch.tensor([comm.rank if failure else comm.world_size, int(found),
                              -int(found), identity, -identity], dtype=torch.int64,
                             device=comm.device)
        comm.all_reduce(flags, op="min", label="checkpoint load: agreement")
        first, all_found, any_found = int(flags[0]), int(flags[1]), -int(flags[2])
        same = int(flags[3]) == -int(flags[4])
    else:
        first, all_found, any_found = (0 if failure else 1), int(found), int(found)
    if isinstance(failure, CheckpointError):
        raise failure
    if failure is not None:   # the same kind of error on every rank, so callers can react
        raise CheckpointError(f"cannot load checkpoint {where}: {type(failure).__name__}: "
                              f"{failure}") from failure
    if first < comm.world_size:
        raise CheckpointError(f"rank {first} could not read checkpoint {where} (its error is "
                              "in its log); nothing was loaded, the training state is unchanged")
    if not same:
        raise CheckpointError(f"ranks read different saves of {where} (it was saved again "
                              "while they loaded it); nothing was loaded, the training state "
                              "is unchanged")
    if all_found != any_found:
        raise CheckpointError(f"ranks disagree on whether {where} holds a checkpoint (is the "
                              "directory on storage every rank sees?); nothing was loaded")


# --------------------------------------------------------------------------- JSON state
def _check_small(state: TrainingState, manifest: dict, *, with_optimizer: bool,
                 with_scheduler: bool, path: str) -> dict:
    """The JSON state to restore, each piece checked against what will receive it."""
    small: dict[str, Any] = {"param_groups": None, "loss_scaler": None, "lr_scheduler": None,
                             "data_loader": None}
    if with_optimizer:
        small["param_groups"] = check_group_values(
            manifest["optimizer"]["param_groups"], state.optimizer.param_groups, path)
        if state.loss_scaler is not None and manifest.get("loss_scaler"):
            small["loss_scaler"] = check_loss_scaler(
                manifest["loss_scaler"], state.loss_scaler.state_dict(), f"checkpoint {path}")
    if with_scheduler and state.lr_scheduler is not None:
        saved = manifest.get("lr_scheduler")
        if saved is not None:
            saved = check_scheduler(saved, state.lr_scheduler.state_dict(),
                                    f"checkpoint {path}")
        small["lr_scheduler"] = saved
    loader, position = state.data_loader, manifest.get("data_loader")
    if loader is not None and position is not None and hasattr(loader, "load_state_dict"):
        if hasattr(loader, "state_dict"):
            position = check_data_loader(position, loader.state_dict(), f"checkpoint {path}")
        small["data_loader"] = position
    return small


def _restore_small(state: TrainingState, small: dict) -> None:
    if small["param_groups"] is not None:
        for group, saved in zip(state.optimizer.param_groups, small["param_groups"]):
            for key, value in saved.items():
                group[key] = _like(group.get(key), value)
    if small["loss_scaler"] is not None:
        state.loss_scaler.load_state_dict(small["loss_scaler"])
    if small["lr_scheduler"] is not None:
        state.lr_scheduler.load_state_dict(small["lr_scheduler"])
    if small["data_loader"] is not None:
        state.data_loader.load_state_dict(small["data_loader"])


def _like(current: Any, value: Any) -> Any:
    """A JSON hyperparameter in the form the optimizer holds it (tuple betas, tensor lr)."""
    if isinstance(current, torch.Tensor):
        return current.copy_(torch.as_tensor(value, dtype=current.dtype))
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    return value
