"""``load_checkpoint``: find the checkpoint, then load it through the one sequence.

Which format a directory holds decides the source (a torch DCP folder, a DeepSpeed
Universal folder, a DeepSpeed ZeRO tag, else zerotrain's own files, read here by
:class:`ZeroTrainFiles`); every source goes through ``staged_load.load_staged`` (Note:
stage, agree, commit), so a load that raises leaves the training state as it was.

Nothing is unpickled: tensors come from ``safetensors.safe_open``, the rest from JSON.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from . import client_state, dcp, deepspeed, fs, rng
from .deepspeed.universal import UniversalCheckpoint, find_universal_dir
from .manifest import (LATEST_NAME, MANIFEST_NAME, CheckpointError, check_tag,
                       file_identity_check, read_manifest, save_identity)
from .match import check_groups, check_left_out, check_model, checkpoint_shapes
from .reshard import SourceIndex
from .staged_load import LoadOptions, load_staged
from .state import COUNTERS, CheckpointReport, LoadResult, TrainingState
from .stfile import DTYPES_BY_NAME, Reader

logger = logging.getLogger(__name__)


def load_checkpoint(state: TrainingState, load_dir: str, *, tag: Optional[str] = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> LoadResult:
    """Load checkpoint ``tag`` (default: the one ``latest`` names) from ``load_dir``.

    Collective. A missing directory or ``latest`` returns ``LoadResult(None, None)`` with a
    warning (as DeepSpeed does); a missing explicit tag raises CheckpointError. Nothing of
    the training state changes until every rank has read and checked everything (Note:
    stage, agree, commit in ``staged_load.py``).
    """
    options = LoadOptions(optimizer=load_optimizer_states and not load_module_only,
                          small=not load_module_only, scheduler=load_lr_scheduler_states)
    dcp_path = dcp.find_dcp_dir(load_dir, tag)
    if dcp_path is not None:   # a torch DCP checkpoint (FSDP2), read like a DeepSpeed tag
        return deepspeed.load_foreign(state, dcp_path, lambda p: dcp.DcpCheckpoint(
            p, state.module), what="torch DCP checkpoint", options=options)
    universal_path = find_universal_dir(load_dir, tag)
    if universal_path is not None:   # ds_to_universal output, before DeepSpeed's own tags
        return deepspeed.load_foreign(state, universal_path, UniversalCheckpoint,
                                      what="DeepSpeed Universal checkpoint", options=options)
    latest, is_deepspeed = _agreed_source(state.comm, load_dir, tag)
    if is_deepspeed:   # a DeepSpeed ZeRO checkpoint (docs/from-deepspeed.md)
        named = tag if tag is not None else latest
        path = deepspeed.find_tag_dir(load_dir, named) or os.path.join(load_dir, named)
        return deepspeed.load_foreign(state, path, deepspeed.DeepSpeedCheckpoint,
                                      what="DeepSpeed checkpoint", options=options)

    def locate() -> Optional[str]:
        if isinstance(latest, CheckpointError):
            raise latest
        return _resolve(load_dir, tag, latest)
    return load_staged(state, locate, ZeroTrainFiles, what="checkpoint", where=load_dir,
                       options=options)


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


class ZeroTrainFiles:
    """A zerotrain tag directory as a ``LoadSource``: its validated manifest, the index of
    its parameters by name (``reshard.py``) and one lazy safetensors reader, whose files
    are checked to come from the save that wrote the manifest as each is opened."""

    def __init__(self, path: str) -> None:
        self.path = self.groups_where = path
        self.state_where = f"checkpoint {path}"
        self.scalars_where = os.path.join(path, MANIFEST_NAME)   # optimizer scalars' file
        self.manifest = read_manifest(path)
        self.index = SourceIndex(self.manifest)
        self.reader = Reader(path, on_open=file_identity_check(self.manifest, path))
        self._left_out: frozenset = frozenset()

    def validate(self, module: torch.nn.Module, records: list,
                 param_groups: Optional[list]) -> None:
        check_model(checkpoint_shapes(self.manifest), module, records, self.state_where)
        self._left_out = check_left_out(self.manifest, module, self.state_where)
        if param_groups is not None:
            check_groups(self.manifest, param_groups, self.path)

    def left_out(self) -> frozenset:
        return self._left_out

    def read_range(self, name: str, key: str, start: int, end: int,
                   out: torch.Tensor) -> None:
        self.index.read_into(self.reader, name, key, start, end, out)

    def read_same_shard(self, names, layout, key: str, rank: int, out: torch.Tensor) -> bool:
        same = self.index.same_record(names, layout)
        if same is not None:
            self.index.read_record_shard(self.reader, same, key, rank, out)
        return same is not None

    def optimizer_state_spec(self, names) -> tuple[list, dict]:
        """The state keys of the source records these parameters come from (one spec)."""
        sources = [self.index.params[n].record for n in names if n in self.index.params]
        if not sources:
            return [], {}
        first = sources[0]
        for other in sources[1:]:
            if (other["state_tensors"], other["state_scalars"]) != \
                    (first["state_tensors"], first["state_scalars"]):
                raise CheckpointError(f"source records {first['key']!r} and {other['key']!r} "
                                      "have different optimizer state; cannot merge them")
        scalars = {}
        for key, spec in first["state_scalars"].items():
            dtype = None if spec["dtype"] == "python" else DTYPES_BY_NAME.get(spec["dtype"])
            if dtype is None and spec["dtype"] != "python":
                raise CheckpointError(f"optimizer scalar has unsupported dtype "
                                      f"{spec['dtype']!r}")
            scalars[key] = (spec["value"], dtype)
        scalars.update({key: (None, None) for key in first.get("state_none", [])})
        return list(first["state_tensors"]), scalars

    def saved_module_tensor(self, name: str) -> Optional[torch.Tensor]:
        if name not in self.index.module_entries:
            return None
        return self.index.read_module(self.reader, name)

    def rng_state(self, comm) -> Optional[tuple]:
        manifest = self.manifest
        if manifest["world_size"] != comm.world_size:
            logger.info("world size changed (%d -> %d): random generators are not restored",
                        manifest["world_size"], comm.world_size)
            return None
        filename = manifest["rank_files"][comm.rank]
        tensors = {k: self.reader.read(filename, k) for k in self.reader.handle(filename).keys()
                   if k.startswith(rng.PREFIX)}
        meta = self.reader.metadata(filename).get("rng")
        where = os.path.join(self.path, filename)
        if meta is None:
            raise CheckpointError(f"checkpoint file {where} has no random-generator state")
        try:
            rng.check(tensors, meta)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint file {where}: {exc}") from None
        return tensors, meta

    def client_state(self) -> dict:
        return client_state.load(self.manifest, self.path)

    def saved_param_groups(self, live_groups: list) -> list:
        return self.manifest["optimizer"]["param_groups"]

    def loss_scaler_state(self) -> Any:
        return self.manifest.get("loss_scaler") or None

    def lr_scheduler_state(self) -> Any:
        return self.manifest.get("lr_scheduler")

    def data_loader_state(self) -> Any:
        return self.manifest.get("data_loader")

    def counters(self) -> dict:
        return {key: int(self.manifest["counters"][key]) for key in COUNTERS}

    def identity(self) -> int:
        return save_identity(str(self.manifest.get("save_id") or self.manifest["counters"]))

    def report(self) -> CheckpointReport:
        return CheckpointReport(path=self.path, elements_read=self.reader.elements_read,
                                bytes_read=self.reader.bytes_read,
                                files_opened=self.reader.files_opened)

    def malformed(self, exc: Exception) -> Exception:
        return exc   # the agreement names it ("cannot load checkpoint ...")

    def close(self) -> None:
        self.reader.close()
