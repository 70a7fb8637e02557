"""``load_checkpoint``: read exactly this rank's element ranges, then publish.

Order (all ranks call it):
1. resolve the tag (``latest`` by default) and validate the manifest, the files' sizes and
   the model's names and shapes: local work, the same on every rank, so a bad checkpoint
   raises everywhere before any collective;
2. for every record of this rank's stage, fill the master shard (and fresh optimizer-state
   tensors) from the source ranges (``reshard.py``, Note: element ranges); load frozen
   parameters and buffers;
3. one scalar all-reduce: if any rank failed to read, every rank raises;
4. ``stage.publish_parameters()`` (collective) writes the masters into the module;
5. hyperparameters, scheduler, loss scaler, data position and RNG (same world size only).

Nothing is unpickled: tensors come from ``safetensors.safe_open``, the rest from JSON.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import torch

from ..stages.base import FROZEN
from . import client_state, deepspeed, fs, rng
from .manifest import CheckpointError, read_manifest
from .match import check_groups, check_model
from .reshard import SourceIndex, target_range
from .state import COUNTERS, CheckpointReport, LoadResult, TrainingState, shard_rank
from .stfile import DTYPES_BY_NAME, Reader

logger = logging.getLogger(__name__)


def load_checkpoint(state: TrainingState, load_dir: str, *, tag: Optional[str] = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> LoadResult:
    """Load checkpoint ``tag`` (default: the one ``latest`` names) from ``load_dir``.

    Collective. A missing directory or ``latest`` returns ``LoadResult(None, None)`` with a
    warning (as DeepSpeed does); a missing explicit tag raises CheckpointError.
    """
    deepspeed_path = deepspeed.find_tag_dir(load_dir, tag)
    if deepspeed_path is not None:   # a DeepSpeed ZeRO checkpoint (docs/from-deepspeed.md)
        return deepspeed.load_deepspeed_checkpoint(
            state, deepspeed_path, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
    start = time.perf_counter()
    path = _resolve(load_dir, tag)
    if path is None:
        return LoadResult(None, None)
    manifest = read_manifest(path)
    records = state.stage.shard_records() + state.stage.frozen_records()
    index = SourceIndex(manifest)
    check_model(manifest, state.module, records, path)
    with_optimizer = load_optimizer_states and not load_module_only
    if with_optimizer:
        check_groups(manifest, state.optimizer.param_groups, path)
    failure: Optional[BaseException] = None
    rng_state = None
    saved_client: dict = {}
    report = CheckpointReport(path=path)
    with Reader(path) as reader:
        try:
            for record in records:
                _load_record(state, index, reader, record, with_optimizer=(
                    with_optimizer and record.group_index != FROZEN))
            _load_module_tensors(state.module, index, reader, records)
            report = CheckpointReport(path=path, elements_read=reader.elements_read,
                                      bytes_read=reader.bytes_read)
            if not load_module_only:
                rng_state = _read_rng(manifest, reader, state.comm)
            saved_client = client_state.load(manifest, path)
        except Exception as exc:  # noqa: BLE001 - re-raised after every rank agrees
            failure = exc
        report.files_opened = reader.files_opened
    _agree(state, records, failure, path)
    state.stage.publish_parameters()
    counters = None
    if not load_module_only:
        _restore_small(state, manifest, with_optimizer=with_optimizer,
                       with_scheduler=load_lr_scheduler_states)
        if rng_state is not None:
            rng.restore(*rng_state)
        counters = {k: int(manifest["counters"][k]) for k in COUNTERS}
    report.seconds = time.perf_counter() - start
    logger.info("loaded checkpoint %s in %.3f s (%d bytes of shards read on rank 0)", path,
                report.seconds, report.bytes_read)
    return LoadResult(path, saved_client, counters, report)


def _resolve(load_dir: str, tag: Optional[str]) -> Optional[str]:
    if tag is not None:
        found = fs.tag_dir(load_dir, tag)
        if found is None:
            raise CheckpointError(f"checkpoint tag {tag!r} was not found in {load_dir} (no "
                                  f"{os.path.join(load_dir, tag, 'manifest.json')})")
        return found
    if not os.path.isdir(load_dir):
        logger.warning("no checkpoint directory %s; nothing loaded", load_dir)
        return None
    latest = fs.read_latest(load_dir)
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
def _load_record(state: TrainingState, index: SourceIndex, reader: Reader, record, *,
                 with_optimizer: bool) -> None:
    """Fill this rank's master shard and, with the optimizer, fresh state tensors."""
    rank = shard_rank(record.layout, state.comm)
    same = index.same_record(list(record.names), record.layout)
    keys, scalars, nones = _state_spec(index, record.names) if with_optimizer else ([], {}, [])
    fresh = {key: _target(record.optimizer_state.get(key), record.master) for key in keys}
    for key, out in [("master", record.master), *fresh.items()]:
        if same is not None:
            index.read_record_shard(reader, same, key, rank, out)
            continue
        for slot, name in zip(record.layout.slots, record.names):
            begin, end = target_range(record.layout, slot, rank)
            at = record.layout.shard_slice(slot).start
            index.read_into(reader, name, key, begin, end, out[at: at + end - begin])
    if not with_optimizer:
        return
    group = state.optimizer.param_groups[record.group_index]
    live = record.optimizer_state
    live.clear()
    live.update(fresh)
    live.update({key: _scalar(spec, group, record.master) for key, spec in scalars.items()})
    live.update({key: None for key in nones})
    state.optimizer.state[record.master] = live


def _target(live: Any, master: torch.Tensor) -> torch.Tensor:
    """Where to read a state tensor: the live one when it fits (offloaded state stays in its
    host or NVMe storage), else a new one like the master."""
    if (isinstance(live, torch.Tensor) and live.shape == master.shape
            and live.dtype == master.dtype and live.device == master.device):
        return live.zero_()
    return torch.zeros_like(master)


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
    return torch.tensor(spec["value"], dtype=dtype,
                        device=master.device if on_device else torch.device("cpu"))


def _load_module_tensors(module: torch.nn.Module, index: SourceIndex, reader: Reader,
                         records) -> None:
    """Frozen parameters and persistent buffers, cast to the module's dtypes."""
    in_records = {name for record in records for name in record.names}
    persistent = set(module.state_dict().keys())
    targets = [(n, p) for n, p in module.named_parameters() if n not in in_records]
    targets += [(n, b) for n, b in module.named_buffers() if n in persistent]
    for name, target in targets:
        if name in index.module_entries:
            value = index.read_module(reader, name)
        else:  # trainable when saved, frozen now: rebuild it from the master shards
            value = torch.empty(target.numel(), dtype=torch.float32)
            index.read_into(reader, name, "master", 0, target.numel(), value)
        if value.is_floating_point() != target.is_floating_point():
            raise CheckpointError(f"{name!r} is {value.dtype} in the checkpoint but "
                                  f"{target.dtype} in the model")
        with torch.no_grad():
            target.copy_(value.view(target.shape))


def _read_rng(manifest: dict, reader: Reader, comm) -> Optional[tuple]:
    if manifest["world_size"] != comm.world_size:
        logger.info("world size changed (%d -> %d): random generators are not restored",
                    manifest["world_size"], comm.world_size)
        return None
    filename = manifest["rank_files"][comm.rank]
    handle = reader.handle(filename)
    tensors = {k: reader.read(filename, k) for k in handle.keys() if k.startswith(rng.PREFIX)}
    meta = reader.metadata(filename).get("rng")
    if meta is None:
        raise CheckpointError(f"checkpoint file {os.path.join(reader.directory, filename)} "
                              "has no random-generator state")
    return tensors, meta


def _agree(state: TrainingState, records, failure: Optional[BaseException], path: str) -> None:
    """One scalar all-reduce (min over ranks of the first failing rank): all raise or none."""
    comm = state.comm
    if comm.world_size > 1:
        flag = torch.tensor([comm.rank if failure else comm.world_size], device=comm.device)
        comm.all_reduce(flag, op="min")
        first = int(flag.item())
    else:
        first = 0 if failure else 1
    if failure is not None:
        raise failure
    if first < comm.world_size:
        raise CheckpointError(f"rank {first} could not read checkpoint {path} (its error is "
                              "in its log); the model was not updated")


# --------------------------------------------------------------------------- JSON state
def _restore_small(state: TrainingState, manifest: dict, *, with_optimizer: bool,
                   with_scheduler: bool) -> None:
    if with_optimizer:
        for group, saved in zip(state.optimizer.param_groups,
                                manifest["optimizer"]["param_groups"]):
            for key, value in saved.items():
                group[key] = _like(group.get(key), value)
        if state.loss_scaler is not None and manifest.get("loss_scaler"):
            state.loss_scaler.load_state_dict(manifest["loss_scaler"])
    scheduler = state.lr_scheduler
    if with_scheduler and scheduler is not None and manifest.get("lr_scheduler") is not None:
        scheduler.load_state_dict(manifest["lr_scheduler"])
    loader, position = state.data_loader, manifest.get("data_loader")
    if loader is not None and position is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(position)


def _like(current: Any, value: Any) -> Any:
    """A JSON hyperparameter in the form the optimizer holds it (tuple betas, tensor lr)."""
    if isinstance(current, torch.Tensor):
        return current.copy_(torch.as_tensor(value, dtype=current.dtype))
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    return value
