"""A DeepSpeed ZeRO tag as zerotrain needs it: parameters by name, element-range reads of
fp32 masters and optimizer moments, and the small state (counters, scheduler, loss scaler,
optimizer hyperparameters, ``client_state``).

Opening reads every file of the tag (memory-mapped: only the elements later copied are
paged in), so a bad file raises on every rank before a load's first collective.
"""
from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch

from ..manifest import MALFORMED, CheckpointError, save_identity
from . import files
from .layout import SourceParam, zero12_params, zero3_params
from .source_checks import (check_base_state, check_flat_sizes, check_flats, malformed,
                            world_size)
from .unpickle import DeepSpeedRecord

# Keys DeepSpeed itself writes into the model-states file; any other key is client_state.
_DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "csr_tensor_module_names", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "iteration"})
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening",
                    "nesterov")


class DeepSpeedCheckpoint:
    """One DeepSpeed tag directory, opened and indexed (no process group needed)."""

    def __init__(self, path: str) -> None:
        try:
            self._open(path)
        except CheckpointError:
            raise
        except MALFORMED as exc:   # a field of the wrong type or size
            raise malformed(path, exc) from None

    def _open(self, path: str) -> None:
        self.path = path
        tag_files = files.list_files(path)
        self.model_file = tag_files.model_files[0]
        self._rank_models = [files.read(f) for f in tag_files.model_files]   # stage 3: one
        self.model = self._rank_models[0]                                   # per rank
        self.optim = [_optimizer_dict(files.read(f), f) for f in tag_files.optim_files]
        self.optim_files = tag_files.optim_files
        shapes = self.model.get("param_shapes")
        if not isinstance(shapes, list):
            raise CheckpointError(f"{tag_files.model_files[0]} has no param_shapes: the run "
                                  "did not use ZeRO (stage 0), whose checkpoints are not read")
        self.world = world_size(self.model.get("dp_world_size"), len(self.optim),
                                 self.model_file)
        for i, state in enumerate(self.optim):
            check_flats(state, self.optim_files[i])
            check_base_state(state, self.optim_files[i])
        check_flat_sizes(self.optim, self.optim_files)
        if self.optim and len(self.optim) != self.world:
            raise CheckpointError(f"{path}: dp_world_size is {self.world} but there are "
                                  f"{len(self.optim)} optimizer-state files")
        self.stage3 = len(tag_files.model_files) > 1 or bool(
            self.optim and "fp32_flat_groups" in self.optim[0])
        self.params: dict[str, SourceParam] = {
            p.name: p for p in (self._index(shapes) if self.optim else [])}
        self.shapes = {name: tuple(shape) for group in shapes for name, shape in group.items()}
        self._flats = self._flat_tensors() if self.optim else []

    # ------------------------------------------------------------------ structure
    @property
    def has_optimizer(self) -> bool:
        return bool(self.optim)

    @property
    def stage(self) -> int:
        if self.stage3:
            return 3
        record = self.optim[0].get("zero_stage") if self.optim else None
        if isinstance(record, DeepSpeedRecord) and record.args:
            return int(record.args[0])
        return 1 if self.optim else 2

    def _index(self, shapes: list) -> list[SourceParam]:
        first = self.optim[0]
        if self.stage3:
            flats = first["fp32_flat_groups"]
            groups = _group_of_flat(first["optimizer_state_dict"], len(flats))
            return zero3_params(shapes, [t.numel() for t in flats], groups, self.world)
        flats = first["single_partition_of_fp32_groups"]
        lean = "zero_stage" in first          # stages 1-2 save partitions without padding
        paddings = first.get("group_paddings") or [0] * len(flats)
        if len(flats) != len(shapes):
            raise CheckpointError(f"{self.optim_files[0]}: {len(flats)} fp32 partitions for "
                                  f"{len(shapes)} parameter groups in param_shapes")
        sizes = [t.numel() + (paddings[g] if lean else 0) for g, t in enumerate(flats)]
        return zero12_params(shapes, sizes, first.get("param_alignment_paddings"), self.world)

    def _flat_tensors(self) -> list[list[dict[str, torch.Tensor]]]:
        """Per rank, per flat partition: ``{"master": fp32, "exp_avg": ..., ...}``."""
        out = []
        for rank, state in enumerate(self.optim):
            key = "fp32_flat_groups" if self.stage3 else "single_partition_of_fp32_groups"
            masters = state[key]
            moments = _moments(state, len(masters), stage3=self.stage3)
            # saved with requires_grad (they were the optimizer's leaves): detach, so that
            # copying them never records autograd history into the live shards
            out.append([{k: (v.detach() if isinstance(v, torch.Tensor) else v)
                         for k, v in {"master": m, **moments[i]}.items()}
                        for i, m in enumerate(masters)])
        return out

    def identity(self) -> int:
        """A hash of this save (step counters, every file's size): ranks that read two saves
        of one tag (re-saved meanwhile) differ here, and the load's agreement refuses."""
        sizes = [os.path.getsize(f) for f in (self.model_file, *self.optim_files)]
        return save_identity(repr((self.model.get("global_steps"),
                                   self.model.get("global_samples"), sizes)))

    # ------------------------------------------------------------------ tensors
    def read_into(self, name: str, key: str, start: int, end: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, end)`` of ``name``'s ``key`` (``master``, ``exp_avg``,
        ...) into the 1-D ``out``, converting to ``out``'s dtype."""
        if end <= start:
            return
        source = self.params.get(name)
        if source is None:
            value = self.module_tensor(name).reshape(-1)
            if key != "master":
                raise CheckpointError(f"{self.path} has no optimizer state {key!r} for "
                                      f"{name!r}; load with load_optimizer_states=False")
            with torch.no_grad():
                out.copy_(value[start:end])
            return
        for piece in source.pieces:
            lo, hi = max(start, piece.start), min(end, piece.end)
            if lo >= hi:
                continue
            tensors = self._flats[piece.rank][piece.flat]
            if key not in tensors:
                raise CheckpointError(f"{self.optim_files[piece.rank]} has no optimizer state "
                                      f"{key!r} for {name!r}")
            begin = piece.offset + lo - piece.start
            with torch.no_grad():
                out[lo - start: hi - start].copy_(tensors[key][begin: begin + hi - lo])

    def state_keys(self, name: str) -> tuple[list[str], Optional[float]]:
        """Moment keys (flat tensors) and the step count of ``name``'s optimizer state."""
        source = self.params[name]
        piece = source.pieces[0]
        tensors = self._flats[piece.rank][piece.flat]
        keys = [k for k in tensors if k not in ("master", "_step")]
        return keys, self._step(source.group, tensors)

    def _step(self, group: int, tensors: dict) -> Optional[float]:
        state = self.optim[0]
        groups = self.param_groups()
        for value in (tensors.get("_step"), (groups[group] if group < len(groups) else {}
                                             ).get("step"),
                      state.get("base_optimizer_state_step")):
            if value is not None:
                return float(value)
        return None

    def module_tensor(self, name: str) -> torch.Tensor:
        """A frozen parameter, buffer or (without optimizer files) module weight, whole."""
        module = self.model.get("module") or {}
        value = module.get(name)
        if isinstance(value, torch.Tensor) and tuple(value.shape) == self.full_shape(name):
            return value.detach()
        fragments = [m.get("frozen_param_fragments") or {}
                     for m in self._rank_models] if self.stage3 else []
        if fragments and all(name in f for f in fragments):
            numel = math.prod(self.full_shape(name))
            flat = torch.cat([f[name].reshape(-1) for f in fragments])[:numel]
            return flat.view(self.full_shape(name))
        if name in self.shapes and not self.optim:
            raise CheckpointError(f"{self.path} has no optimizer-state files, and at stage 3 "
                                  f"the module weights ({name!r}) live only there")
        raise CheckpointError(f"{name!r} is not in DeepSpeed checkpoint {self.path}")

    def full_shape(self, name: str) -> tuple[int, ...]:
        if name in self.shapes:
            return self.shapes[name]
        frozen = self.model.get("frozen_param_shapes") or {}
        if name in frozen:
            return tuple(frozen[name])
        value = (self.model.get("module") or {}).get(name)
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        raise CheckpointError(f"{name!r} is not in DeepSpeed checkpoint {self.path}")

    # ------------------------------------------------------------------ names
    def trainable_names(self) -> list[str]:
        return list(self.shapes)

    def buffer_names(self) -> list[str]:
        return list(self.model.get("buffer_names") or [])

    def frozen_names(self) -> list[str]:
        """Parameters the optimizer did not own (frozen), by DeepSpeed's records."""
        frozen = list((self.model.get("frozen_param_shapes") or {}).keys())
        buffers, shared = set(self.buffer_names()), self.shared_params()
        for name in (self.model.get("module") or {}):
            if name not in self.shapes and name not in buffers and name not in frozen \
                    and name not in shared:
                frozen.append(name)
        return frozen

    def shared_params(self) -> dict[str, str]:
        """Tied parameters: ``{alias: name it shares storage with}``."""
        return dict(self.model.get("shared_params") or {})

    def state_dict_order(self) -> list[str]:
        module = list((self.model.get("module") or {}).keys())
        rest = [n for n in self.trainable_names() + self.frozen_names() if n not in module]
        return module + rest

    # ------------------------------------------------------------------ small state
    def counters(self) -> dict[str, int]:
        out = {}
        for key in ("global_steps", "global_samples", "skipped_steps"):
            value = self.model.get(key)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool):
                    raise CheckpointError(f"{self.model_file}: {key} is {value!r}; expected "
                                          "an integer count")
                out[key] = value
        return out

    def client_state(self) -> dict:
        """The script's own keys, each tensor a copy (never a view of the mapped file). Each
        object is walked once (shared lists stay shared, cycles are refused) and what the
        copies allocate is bounded by the file's size (Note: client values are bounded)."""
        budget = [_COPY_SLACK + _COPY_RATIO * os.path.getsize(self.model_file)]
        memo: dict[int, Any] = {}
        return {k: _detached(v, memo, budget, f"{self.model_file}: client_state[{k!r}]", 0)
                for k, v in self.model.items() if k not in _DS_KEYS}

    def lr_scheduler_state(self) -> Any:
        """As saved, unchecked: the load refuses what the live scheduler cannot take."""
        return self.model.get("lr_scheduler")

    def param_groups(self) -> list[dict]:
        """The base optimizer's saved parameter groups (hyperparameters), if saved."""
        if not self.optim:
            return []
        state = self.optim[0]
        saved = state.get("optimizer_state_dict") if self.stage3 else state.get(
            "base_optimizer_state")
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        return list(groups or [])

    def hyperparameters(self) -> list[dict]:
        return [{k: g[k] for k in _HYPERPARAMETERS if k in g} for g in self.param_groups()]

    def loss_scaler_state(self) -> Optional[dict]:
        """DeepSpeed's fp16 loss scaler as zerotrain's ``LossScaler.state_dict()`` fields;
        None for fp32 and bf16 runs, whose static scale of 1 must not replace an fp16
        scaler configured here."""
        record = self.optim[0].get("loss_scaler") if self.optim else None
        if not isinstance(record, DeepSpeedRecord):
            return None
        a = record.attributes()
        dynamic = bool(a.get("dynamic", record.qualname.endswith("DynamicLossScaler")))
        config = self.model.get("ds_config")
        fp16 = isinstance(config, dict) and isinstance(config.get("fp16"), dict) \
            and bool(config["fp16"].get("enabled"))
        if not (fp16 or dynamic):     # fp32/bf16 runs keep a static scale of 1: not fp16 state
            return None
        out = {"loss_scale": float(a.get("cur_scale", 1.0)), "dynamic": dynamic}
        for ours, theirs in (("scale_window", "scale_window"), ("hysteresis", "delayed_shift"),
                             ("cur_hysteresis", "cur_hysteresis"),
                             ("consecutive_hysteresis", "consecutive_hysteresis"),
                             ("min_scale", "min_scale"), ("scale_factor", "scale_factor"),
                             ("cur_iter", "cur_iter"),
                             ("last_overflow_iter", "last_overflow_iter")):
            if theirs in a:
                out[ours] = a[theirs]
        return out


def _optimizer_dict(value: dict, path: str) -> dict:
    state = value.get("optimizer_state_dict")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} has no optimizer_state_dict")
    if "fp32_flat_groups" not in state and "single_partition_of_fp32_groups" not in state:
        raise CheckpointError(f"{path}: optimizer_state_dict has neither fp32_flat_groups "
                              "nor single_partition_of_fp32_groups; not a ZeRO checkpoint "
                              "this version understands")
    return state


def _group_of_flat(saved: dict, count: int) -> list[int]:
    """Stage 3: the optimizer group each flat (sub-group) partition belongs to."""
    groups = [0] * count
    for g, group in enumerate((saved or {}).get("param_groups") or []):
        for index in group.get("params", []):
            if isinstance(index, int) and 0 <= index < count:
                groups[index] = g
    return groups


def _moments(state: dict, count: int, *, stage3: bool) -> list[dict]:
    """Per flat partition, its optimizer state tensors (and ``_step``)."""
    saved = state.get("optimizer_state_dict" if stage3 else "base_optimizer_state")
    if isinstance(saved, dict):
        per_flat = [saved.get("state", {}).get(i, {}) for i in range(count)]
    elif isinstance(saved, list):      # elastic checkpoints: one lean state per group
        per_flat = list(saved) + [{}] * (count - len(saved))
    else:
        per_flat = [{}] * count
    out = []
    for entry in per_flat:
        tensors = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        step = entry.get("step")
        if step is not None:
            tensors["_step"] = step
        out.append(tensors)
    return out


# Note: client values are bounded
#     ``client_state`` is whatever the script saved, read from a file nobody here wrote. Its
#     walk keeps one copy per object (a list shared 60 times deep is 60 objects, not 2**60
#     paths), refuses a cycle or nesting deeper than :data:`_MAX_DEPTH`, and lets the tensor
#     copies allocate at most ``_COPY_RATIO`` times the file's size plus ``_COPY_SLACK``: a
#     stride-0 ``expand`` or a storage the file does not hold cannot make a few-KB file
#     allocate gigabytes. An over-budget value is refused naming its key.
_MAX_DEPTH = 100
_COPY_RATIO = 2
_COPY_SLACK = 1 << 20
_ACTIVE = object()


def _detached(value: Any, memo: dict, budget: list, where: str, depth: int) -> Any:
    if isinstance(value, (str, bytes, int, float, complex, bool, type(None))):
        return value
    known = memo.get(id(value))
    if known is _ACTIVE:
        raise CheckpointError(f"{where} refers to itself (a cycle); refusing it")
    if known is not None:
        return known[1]
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"{where} is nested deeper than {_MAX_DEPTH} levels")
    memo[id(value)] = _ACTIVE
    if isinstance(value, torch.Tensor):
        size = value.numel() * value.element_size()
        budget[0] -= size
        if budget[0] < 0:
            raise CheckpointError(f"{where} holds a tensor of shape {tuple(value.shape)} "
                                  f"({size} bytes), more than its file can hold; refusing "
                                  "to allocate it")
        out: Any = value.detach().clone()
    elif isinstance(value, DeepSpeedRecord):
        out = value
    elif isinstance(value, dict):
        out = type(value)((k, _detached(v, memo, budget, f"{where}[{k!r}]", depth + 1))
                          for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        out = type(value)(_detached(v, memo, budget, f"{where}[{i}]", depth + 1)
                          for i, v in enumerate(value))
    else:
        out = value
    memo[id(value)] = (value, out)   # keeps ``value`` alive, so its id is not reused
    return out
