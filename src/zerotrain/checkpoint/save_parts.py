"""What a save writes besides the manifest: each shard record's description and this
rank's tensors for its ``rank<r>.safetensors``, and rank 0's module part (frozen parameters
and persistent buffers, DeepSpeed's module state; Note "frozen parameters left out" in
``save.py``)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import rng
from .manifest import FORMAT, MODULE_FILE, CheckpointError, to_json
from .state import TrainingState, writes_record
from .stfile import TensorSpec, dtype_name, write_file


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


def record_meta(record) -> dict:
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


def rank_items(state: TrainingState, records) -> tuple[list[tuple[str, torch.Tensor]], str]:
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


def whole_module_on_every_rank(state: TrainingState) -> bool:
    """Stages 0-2 without tensor parallelism (which leaves rank 0 a slice of a split
    layer): then rank 0's module is the model, and DeepSpeed's module file is written."""
    return (state.stage_index < 3
            and state.stage.tensor_parallel_world_size == 1)


def frozen_records(state: TrainingState, exclude_frozen: bool) -> list:
    """The stage's frozen shard records (stage 3), less those whose parameters all need
    no gradient when they are left out."""
    records = state.stage.frozen_records()
    if not exclude_frozen:
        return records
    needs_grad = {n for n, p in state.module.named_parameters() if p.requires_grad}
    return [r for r in records if any(n in needs_grad for n in r.names)]


def module_tensors(module: torch.nn.Module, metas: list[dict],
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


def write_module_file(tmp: str, tensors: dict[str, torch.Tensor], save_id: str) -> int:
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    return write_file(os.path.join(tmp, MODULE_FILE), specs, lambda s: tensors[s.key],
                      metadata={"format": FORMAT, "save": save_id})
