"""``save_checkpoint``: every rank writes its shards, rank 0 the manifest, then publishes.

Order (all ranks call it; Note: atomic publication in ``fs.py``):
1. every rank describes its records and checks its JSON state locally; rank 0 tidies the
   save directory and creates the temp directory;
2. one ``all_gather_object`` of that small metadata: every rank learns the temp directory
   and every rank raises the first error any rank found, so no rank is left waiting;
3. every rank writes ``rank<r>.safetensors`` (its master shards, optimizer state, RNG);
4. a second gather of file sizes and errors; rank 0 writes ``module.safetensors`` (frozen
   parameters and buffers), at stages 0-2 DeepSpeed's ``mp_rank_00_model_states.pt``
   (``deepspeed/module_file.py``) and ``manifest.json``, then renames the tag into place,
   rewrites ``latest`` and leaves the recovery script ``zero_to_fp32.py`` in ``save_dir``
   (``recovery.py``);
5. a last gather of rank 0's outcome, so every rank returns (or raises) together.

Note: frozen parameters left out
    ``exclude_frozen_parameters`` (DeepSpeed's argument) leaves out every parameter that
    needs no gradient and is in no optimizer record: it is neither in ``module.safetensors``
    nor (at stage 3) in a frozen shard record, and the manifest lists it under
    ``excluded_frozen`` (name, shape, dtype). A load keeps such a parameter as the model
    holds it and restores everything else; a model in which it is trainable cannot load
    the checkpoint (an error names it); export and consolidation write the rest and warn.

An asynchronous save (``writer``) does steps 1-2, copies what steps 3-4 write into the
writer's staging buffer, agrees on that copy (a gather: where one rank failed, every rank
raises and no writer starts) and returns; the writer's thread does 3-4, with marker files
in place of the second gather, and the collective ``wait`` exchanges the writers' outcomes
in place of the third (Note: asynchronous save in ``writer.py``).

Before any of it the engine checks that every rank is saving (``engine/accumulation.py``,
``_agree_on_call``), and rank 0 waits for a save of this process still being written into
the same directory (Note "saves in flight per directory" in ``writer.py``).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import client_state as client
from . import fs, recovery, rng
from . import writer as writer_mod
from .deepspeed import module_file
from .manifest import (FORMAT, MANIFEST_NAME, MODULE_FILE, VERSION, CheckpointError,
                       check_tag, to_json)
from .state import COUNTERS, CheckpointReport, TrainingState, shard_rank, writes_record
from .stfile import TensorSpec, dtype_name, fsync_path, specs_of, write_file
from .writer import BackgroundWriter
from ..comm import group_timeout

logger = logging.getLogger(__name__)


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def save_checkpoint(state: TrainingState, save_dir: str, *, tag: Optional[str] = None,
                    client_state: Optional[dict] = None, save_latest: bool = True,
                    writer: Optional[BackgroundWriter] = None,
                    exclude_frozen_parameters: bool = False) -> CheckpointReport:
    """Write checkpoint ``tag`` (default ``global_step<N>``) under ``save_dir``.

    Collective: every rank calls it with the same tag. ``client_state`` (rank 0's is
    kept) holds what ``client_state.py`` supports; anything else raises CheckpointError
    naming its key path, on every rank, before anything is written. With ``writer`` the
    save returns once this rank's state is copied into the writer's staging buffer, and the
    files are written and published in the background (Note: asynchronous save in
    ``writer.py``); the caller has waited for the writer's previous save.
    ``exclude_frozen_parameters``: Note: frozen parameters left out.
    """
    attempt = _Attempt()
    try:
        return _save(state, save_dir, attempt, tag=tag, client_state=client_state,
                     save_latest=save_latest, writer=writer,
                     exclude_frozen=exclude_frozen_parameters)
    finally:
        if attempt.locked and not attempt.handed_over:
            fs.unlock(save_dir)   # rank 0's save lock, taken in fs.prepare by this save only


@dataclass
class _Attempt:
    """What this call holds: rank 0's save lock (``locked``: never release another save's,
    an asynchronous one still writing there), and whether its writer took it over."""

    locked: bool = False
    handed_over: bool = False


def _save(state: TrainingState, save_dir: str, attempt: _Attempt, *, tag: Optional[str],
          client_state: Optional[dict], save_latest: bool,
          writer: Optional[BackgroundWriter], exclude_frozen: bool) -> CheckpointReport:
    start = time.perf_counter()
    comm = state.comm
    tag = f"global_step{state.counters['global_steps']}" if tag is None else tag
    records = state.stage.shard_records() + _frozen_records(state, exclude_frozen)
    local: dict[str, Any] = {"tag": tag, "error": None, "nonce": None, "records": [],
                             "save_dir": os.path.normpath(os.fspath(save_dir))}
    small: dict = {}
    client_tensors: dict[str, torch.Tensor] = {}
    module_part = ModulePart()
    manifest: dict = {}
    try:
        check_tag(tag)
        local["records"] = [_record_meta(r) for r in records]
        for record in records:
            shard_rank(record.layout, comm)   # a layout checkpoints cannot map raises here
        small, client_tensors = _small_state(state, client_state)
        if comm.rank == 0:   # rank 0's records are everyone's (checked by _raise_first)
            module_part = _module_tensors(state.module, local["records"], exclude_frozen)
            manifest = _manifest(state, tag, local["records"], small)
            if _whole_module_on_every_rank(state):   # DeepSpeed's module file, no gather
                module_part.deepspeed = module_file.live_module_state(
                    state.module, exclude_frozen_parameters=exclude_frozen)
            fs.require_dir(save_dir)
            writer_mod.wait_for_directory(save_dir)   # another engine's save in flight there
            local["nonce"] = fs.new_nonce()
            attempt.locked = True   # a lock() that fails holds nothing, so unlock is safe
            fs.prepare(save_dir, tag, local["nonce"])
    except (CheckpointError, OSError) as exc:
        local["error"] = f"rank {comm.rank}: {exc}"
    everyone = comm.all_gather_object(local, label="checkpoint save: metadata")
    _raise_first(everyone)
    tmp = fs.temp_dir(save_dir, tag, everyone[0]["nonce"])
    if writer is not None:
        report = _save_in_background(state, writer, save_dir, tmp, tag, records, everyone,
                                     client_tensors, save_latest, module_part, manifest,
                                     start)
        attempt.handed_over = True
        return report
    outcome: dict[str, Any] = {"error": None, "size": 0}
    try:
        items, rng_meta = _rank_items(state, records)
        outcome["size"] = _write_rank_file(tmp, comm.rank, items, rng_meta,
                                           everyone[0]["nonce"])
        fs.crash_point("file")
    except (CheckpointError, OSError) as exc:
        outcome["error"] = f"rank {comm.rank}: {exc}"
    written = comm.all_gather_object(outcome, label="checkpoint save: files written")
    final: dict[str, Any] = {"error": None, "bytes": 0, "path": None}
    if comm.rank == 0:
        final = _finish_on_rank0(save_dir, tmp, tag, everyone, written, client_tensors,
                                 save_latest, module_part, manifest)
        fs.unlock(save_dir)   # before the last gather: ranks return to a settled directory
    final = comm.all_gather_object(final, label="checkpoint save: publication")[0]
    if final["error"]:
        raise CheckpointError(final["error"])
    report = CheckpointReport(path=final["path"], seconds=time.perf_counter() - start,
                              bytes_written=outcome["size"] + final["bytes"])
    logger.info("saved checkpoint %s (%d bytes on rank 0) in %.3f s", final["path"],
                report.bytes_written, report.seconds)
    return report


def _save_in_background(state: TrainingState, writer: BackgroundWriter, save_dir: str,
                        tmp: str, tag: str, records, everyone: list[dict],
                        client_tensors: dict[str, torch.Tensor], save_latest: bool,
                        module_part: "ModulePart", manifest: dict,
                        start: float) -> CheckpointReport:
    """Stage this rank's state in the writer's buffer and hand the writing to its thread
    (Note: asynchronous save). Everything taken from the live job is taken here."""
    comm = state.comm
    nonce = everyone[0]["nonce"]
    shared = ("module/", "deepspeed/", "client/")   # rank 0's, written by its thread
    failure: dict[str, Any] = {"error": None}
    try:   # a failure here on one rank must not leave the others' writers running
        items, rng_meta = _rank_items(state, records)
        if comm.rank == 0:
            items += [(f"module/{k}", t) for k, t in module_part.tensors.items()]
            items += [(f"deepspeed/{k}", t) for k, t in (module_part.deepspeed or {}).items()]
            items += [(f"client/{k}", t) for k, t in client_tensors.items()]
        staged = writer.buffer.stage(items)
        own = [(key, staged[key]) for key, _ in items if not key.startswith(shared)]
        if comm.rank == 0:
            module_part = module_part.restaged(staged)
            client_tensors = {k: staged[f"client/{k}"] for k in client_tensors}
    except Exception as exc:  # noqa: BLE001 - every rank raises it after the agreement
        failure["error"] = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
        logger.exception("staging checkpoint %s failed", os.path.join(save_dir, tag))
    outcomes = comm.all_gather_object(failure, label="checkpoint save: staged")
    errors = [o["error"] for o in outcomes if o["error"]]
    if errors:
        if comm.rank == 0:
            fs.remove_quietly(tmp)   # the lock goes in save_checkpoint: nothing handed over
        raise CheckpointError(f"checkpoint {os.path.join(save_dir, tag)} was not saved: "
                              f"{errors[0]}")
    world, rank = comm.world_size, comm.rank
    timeout = _publication_timeout(comm)

    def job(abandon, report) -> None:
        try:
            size = _write_rank_file(tmp, rank, own, rng_meta, nonce)
            fs.crash_point("background")
            writer_mod.write_marker(tmp, rank, size, None)
        except (CheckpointError, OSError) as exc:
            error = f"rank {rank}: {exc}"
            try:
                writer_mod.write_marker(tmp, rank, 0, error)
            except OSError:   # a full disk: the failure must still reach rank 0
                writer_mod.mark_failed(tmp, rank)
            report(str(exc))
            if rank == 0:
                fs.remove_quietly(tmp)
                fs.unlock(save_dir)
            raise
        report(None)   # this rank's part is done (Note "writer outcomes are exchanged")
        if rank != 0:
            return
        try:
            written = writer_mod.wait_markers(tmp, world, abandon, timeout)
            final = _finish_on_rank0(save_dir, tmp, tag, everyone, written, client_tensors,
                                     save_latest, module_part, manifest)
        except CheckpointError:
            fs.remove_quietly(tmp)
            raise
        finally:
            fs.unlock(save_dir)
        if final["error"]:
            raise CheckpointError(final["error"])
        logger.info("saved checkpoint %s in the background", final["path"])

    writer.start(job, f"{os.path.join(save_dir, tag)}", directory=save_dir)
    seconds = time.perf_counter() - start
    logger.info("checkpoint %s staged in %.3f s; writing in the background",
                os.path.join(save_dir, tag), seconds)
    return CheckpointReport(path=os.path.join(save_dir, tag), seconds=seconds)


def _publication_timeout(comm) -> float:
    """How long rank 0's writer waits for the other ranks' files: the group's timeout."""
    try:
        timeout = group_timeout(comm.group)
    except (AttributeError, RuntimeError, ValueError):
        timeout = None
    return 1800.0 if timeout is None else timeout.total_seconds()


def _raise_first(everyone: list[dict]) -> None:
    """Raise on every rank the first problem any rank reported (same message everywhere)."""
    errors = [e["error"] for e in everyone if e["error"]]
    if errors:
        raise CheckpointError(errors[0])
    for rank, other in enumerate(everyone):
        if other["tag"] != everyone[0]["tag"]:
            raise CheckpointError(f"ranks disagree on the checkpoint tag: rank 0 has "
                                  f"{everyone[0]['tag']!r}, rank {rank} has {other['tag']!r}")
        if other["save_dir"] != everyone[0]["save_dir"]:
            # rank 0 creates the save's directory: a rank naming another would write into
            # nothing (a name built from each rank's clock or random draw differs this way).
            # The path as given, not resolved: nodes may mount one name on different disks.
            raise CheckpointError(f"ranks disagree on the checkpoint directory: rank 0 has "
                                  f"{everyone[0]['save_dir']!r}, rank {rank} has "
                                  f"{other['save_dir']!r}; every rank must pass the same "
                                  "save_dir")
        if _structure(other["records"]) != _structure(everyone[0]["records"]):
            raise CheckpointError(f"rank {rank}'s shard records (names, shapes, layouts) "
                                  "differ from rank 0's; cannot write one manifest")


def _structure(metas: list[dict]) -> list:
    return [(m["names"], m["shapes"], m["layout"], m["group_index"]) for m in metas]


def _finish_on_rank0(save_dir: str, tmp: str, tag: str, everyone: list[dict],
                     written: list[dict], client_tensors: dict[str, torch.Tensor],
                     save_latest: bool, module_part: "ModulePart", manifest: dict) -> dict:
    """Rank 0, once every rank has written its file: the module file, the client state,
    the manifest, then publication. ``module_part``: :func:`_module_tensors`'s result;
    ``manifest``: :func:`_manifest`'s, to which the file sizes are added here."""
    errors = [w["error"] for w in written if w["error"]]
    if errors:
        fs.remove_quietly(tmp)
        return {"error": errors[0], "bytes": 0, "path": None}
    try:
        sizes = {rank_file(r): w["size"] for r, w in enumerate(written)}
        save_id = everyone[0]["nonce"]
        sizes[MODULE_FILE] = _write_module_file(tmp, module_part.tensors, save_id)
        manifest = {**manifest, "file_sizes": sizes}
        if client_tensors:
            sizes[client.FILE] = client.write(tmp, client_tensors, save_id)
            manifest["client_state_file"] = client.FILE
        manifest.update(frozen=module_part.frozen, buffers=module_part.buffers,
                        excluded_frozen=module_part.excluded, save_id=save_id)
        if module_part.deepspeed is not None:
            sizes[module_file.MODEL_FILE] = module_file.write_module_file(
                tmp, manifest, module_part.deepspeed, len(written))
            manifest["deepspeed_module_file"] = module_file.MODEL_FILE
        nbytes = _write_json(os.path.join(tmp, MANIFEST_NAME), manifest)
        path = fs.publish(save_dir, tmp, tag, everyone[0]["nonce"], save_latest=save_latest)
    except (CheckpointError, OSError) as exc:
        fs.remove_quietly(tmp)
        return {"error": f"rank 0: {exc}", "bytes": 0, "path": None}
    recovery.write_script(save_dir)
    return {"error": None, "path": path,
            "bytes": nbytes + sizes[MODULE_FILE] + sizes.get(module_file.MODEL_FILE, 0)}


# --------------------------------------------------------------------------- records
# Note: bf16 masters in checkpoints
#     Masters and optimizer state kept in bf16 (``bf16.bf16_master_weights_and_grads``) are
#     written widened to fp32, which holds every bf16 value exactly, so the files, their
#     resharding and consolidation are those of fp32 masters; a load rounds them back into
#     the bf16 tensors, exactly (``staged_load._stage_record`` reads into fp32 buffers).
_SAVED_AS_FP32 = (torch.float32, torch.bfloat16)


def _as_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the file holds it (Note: bf16 masters in checkpoints): itself when
    fp32, else a widened copy."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


def _record_meta(record) -> dict:
    """A record's structure and optimizer-state description (JSON; tensors stay local)."""
    tensors, scalars, nones = [], {}, []
    numel = record.master.numel()
    for key, value in record.optimizer_state.items():
        if value is None:
            nones.append(key)
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.numel() != numel or value.dtype not in _SAVED_AS_FP32:
                raise CheckpointError(
                    f"optimizer state {key!r} of {record.names[:1]}... is {value.dtype} "
                    f"{tuple(value.shape)}; checkpoints hold fp32 state the size of the shard")
            tensors.append(key)
        elif isinstance(value, torch.Tensor):
            scalars[key] = {"dtype": dtype_name(value.dtype), "value": value.item()}
        else:
            scalars[key] = {"dtype": "python", "value": to_json(value, f"optimizer.{key}")}
    return {"names": list(record.names), "shapes": [list(s) for s in record.shapes],
            "layout": record.layout.describe(), "group_index": record.group_index,
            "shard_numel": record.layout.shard_numel, "dtype": dtype_name(torch.float32),
            "state_tensors": tensors, "state_scalars": scalars, "state_none": nones}


def _rank_items(state: TrainingState, records) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """This rank's master shards and optimizer state (records it writes) and its RNG, as
    (key, live tensor) pairs, and the RNG's JSON."""
    items: list[tuple[str, torch.Tensor]] = []
    for i, record in enumerate(records):
        if not writes_record(record.layout, state.comm):
            continue
        items.append((f"rec{i}/master", _as_fp32(record.master)))
        items += [(f"rec{i}/{key}", _as_fp32(value)) for key, value in
                  record.optimizer_state.items()
                  if isinstance(value, torch.Tensor) and value.dim() > 0]
    rng_tensors, rng_meta = rng.capture()
    return items + list(rng_tensors.items()), rng_meta


def _write_rank_file(tmp: str, rank: int, items: list[tuple[str, torch.Tensor]],
                     rng_meta: str, save_id: str) -> int:
    """Write :func:`_rank_items`' tensors; ``save_id`` (the manifest's too) ties the file to
    this save."""
    by_key = dict(items)
    meta = {"format": FORMAT, "rank": str(rank), "rng": rng_meta, "save": save_id}
    size = write_file(os.path.join(tmp, rank_file(rank)), specs_of(items),
                      lambda spec: by_key[spec.key].detach(), metadata=meta)
    fsync_path(tmp)   # this rank's directory entry, also where rank 0 is on another node
    return size


@dataclass(slots=True)
class ModulePart:
    """What rank 0 writes besides the shards: frozen parameters and persistent buffers
    (live tensors, by key) with their manifest entries, the frozen parameters left out
    (Note: frozen parameters left out), and the module state of DeepSpeed's module file
    (None at stage 3)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen: list[dict] = field(default_factory=list)
    buffers: list[dict] = field(default_factory=list)
    excluded: list[dict] = field(default_factory=list)
    deepspeed: Optional[dict] = None

    def restaged(self, staged: dict[str, torch.Tensor]) -> "ModulePart":
        """The same part over the asynchronous writer's staged copies."""
        deepspeed = (None if self.deepspeed is None else
                     {k: staged[f"deepspeed/{k}"] for k in self.deepspeed})
        return ModulePart({k: staged[f"module/{k}"] for k in self.tensors}, self.frozen,
                          self.buffers, self.excluded, deepspeed)


def _whole_module_on_every_rank(state: TrainingState) -> bool:
    """Stages 0-2 without tensor parallelism (which leaves rank 0 a slice of a split
    layer): then rank 0's module is the model, and DeepSpeed's module file is written."""
    return (state.stage_index < 3
            and getattr(state.stage, "tensor_parallel_world_size", 1) == 1)


def _frozen_records(state: TrainingState, exclude_frozen: bool) -> list:
    """The stage's frozen shard records (stage 3), less those whose parameters all need
    no gradient when they are left out."""
    records = state.stage.frozen_records()
    if not exclude_frozen:
        return records
    needs_grad = {n for n, p in state.module.named_parameters() if p.requires_grad}
    return [r for r in records if any(n in needs_grad for n in r.names)]


def _module_tensors(module: torch.nn.Module, metas: list[dict],
                    exclude_frozen: bool = False) -> ModulePart:
    """Frozen parameters (those in no record) and persistent buffers, as they are (live
    tensors), with their manifest entries; with ``exclude_frozen`` the parameters that
    need no gradient are listed as left out instead."""
    in_records = {name for meta in metas for name in meta["names"]}
    persistent = set(module.state_dict(keep_vars=True).keys())
    part = ModulePart()
    tensors, frozen, buffers = part.tensors, part.frozen, part.buffers
    for kind, named, out in (("param", module.named_parameters(), frozen),
                             ("buffer", module.named_buffers(), buffers)):
        for name, tensor in named:
            if name in in_records:
                continue
            if kind == "param" and exclude_frozen and not tensor.requires_grad:
                part.excluded.append({"name": name, "dtype": dtype_name(tensor.dtype),
                                      "shape": list(getattr(tensor, "ds_shape",
                                                            tensor.shape))})
                continue
            if name not in persistent:
                continue
            if tuple(getattr(tensor, "ds_shape", tensor.shape)) != tuple(tensor.shape):
                raise CheckpointError(f"frozen parameter {name!r} is partitioned (stage 3) "
                                      "and is in no shard record; checkpoints cannot save it")
            key = f"{kind}/{name}"
            tensors[key] = tensor.detach()
            out.append({"name": name, "key": key, "shape": list(tensor.shape),
                        "dtype": dtype_name(tensor.dtype)})
    return part


def _write_module_file(tmp: str, tensors: dict[str, torch.Tensor], save_id: str) -> int:
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    return write_file(os.path.join(tmp, MODULE_FILE), specs, lambda s: tensors[s.key],
                      metadata={"format": FORMAT, "save": save_id})


# --------------------------------------------------------------------------- JSON state
def _small_state(state: TrainingState,
                 client_state: Optional[dict]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Every small piece of state as JSON, and the client state's tensors (raises naming
    the first bad key)."""
    groups = [to_json({k: v for k, v in g.items() if k != "params"},
                      f"optimizer.param_groups[{i}]", tensors_as_numbers=True)
              for i, g in enumerate(state.optimizer.param_groups)]
    client_json, client_tensors = client.encode({} if client_state is None else client_state)
    small = {"client_state": client_json,
             "optimizer": {"type": type(state.optimizer).__name__, "param_groups": groups}}
    for name in ("lr_scheduler", "loss_scaler", "data_loader"):
        owner = getattr(state, name)
        small[name] = (to_json(owner.state_dict(), name, tensors_as_numbers=True)
                       if owner is not None and hasattr(owner, "state_dict") else None)
    small["hf_config"] = _hf_config(state.module)
    return small, client_tensors


def _hf_config(module: torch.nn.Module) -> Optional[dict]:
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    try:
        if callable(getattr(config, "to_json_string", None)):  # Hugging Face: JSON-safe keys
            return to_json(json.loads(config.to_json_string()), "module.config")
        return to_json(config.to_dict(), "module.config")
    except (CheckpointError, TypeError, ValueError) as exc:
        logger.warning("not saving the model's config in the checkpoint: %s", exc)
        return None


def _manifest(state: TrainingState, tag: str, metas: list[dict], small: dict) -> dict:
    """Everything of the manifest but the file sizes (known once the files are written)."""
    records = []
    for i, meta in enumerate(metas):
        world = meta["layout"]["world"]
        records.append({"key": f"rec{i}", **meta,
                        "files": [rank_file(r) for r in range(world)]})
    param_dtypes = {n: dtype_name(p.dtype) for n, p in state.module.named_parameters()}
    return {"format": FORMAT, "version": VERSION, "tag": tag,
            "world_size": state.comm.world_size, "stage": state.stage_index,
            "precision": state.precision,
            "counters": {k: int(state.counters[k]) for k in COUNTERS},
            "records": records, "param_dtypes": param_dtypes,
            "state_dict_order": list(state.module.state_dict(keep_vars=True).keys()),
            "module_file": MODULE_FILE,
            "rank_files": [rank_file(r) for r in range(state.comm.world_size)], **small}


def _write_json(path: str, value: dict) -> int:
    data = json.dumps(value, indent=1).encode()
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:   # a full disk names no file by itself
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return len(data)
