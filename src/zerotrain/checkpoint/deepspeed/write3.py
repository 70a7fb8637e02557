"""A zerotrain checkpoint as a DeepSpeed ZeRO stage 3 checkpoint for a chosen world size.

Note: what DeepSpeed 0.19's stage 3 loader needs
    Stage 3 partitions every parameter on its own (Note: DeepSpeed's partitions in
    ``layout.py``): with ``c = ceil(numel / M)`` rank ``r`` holds elements ``[r*c, (r+1)*c)``,
    zero-padded on the last rank. Each optimizer group is cut into sub-groups (a new one
    starts once the per-rank elements reach ``sub_group_size``, 1e9 by default, so a group is
    one sub-group below that) and a rank's fp32 partition of a sub-group is its chunks
    concatenated. Every rank has two files:
    ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``: ``module`` (the buffers, and every
    parameter as an empty tensor: ``load_state_dict`` compares shapes, and a fresh
    DeepSpeed stage 3 engine holds each parameter partitioned, ``torch.Size([0])``, until
    its first forward, the persistent ones included), ``param_shapes`` (one ordered
    dict per sub-group), ``frozen_param_shapes`` and ``frozen_param_fragments`` (frozen and
    zero-element parameters: this rank's chunk of each), the counters, ``lr_scheduler``,
    ``dp_world_size``;
    ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: ``zero_stage``, ``partition_count``,
    ``fp32_flat_groups`` (one partition per sub-group), the base optimizer's
    ``state_dict()`` over those partitions (one "parameter" per sub-group, Adam's moments as
    partitions) and ``loss_scaler``, ``dynamic_loss_scale``, ``overflow``, which stage 3's
    loader reads unconditionally. The loss scaler is the one object DeepSpeed pickles by
    class: it is written as a reference to DeepSpeed's class with plain attributes
    (:class:`write_common.DeepSpeedPickler`), so DeepSpeed need not be installed to write it and
    zerotrain's restricted unpickler reads it back as a record.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..reshard import SourceIndex
from ..stfile import Reader
from .write_common import DS_VERSION, DeepSpeedObject, group_state, model_states, save_file

SUB_GROUP_SIZE = 1_000_000_000        # DeepSpeed's zero_optimization.sub_group_size default


@dataclass
class _SubGroup:
    """One sub-group: its parameters and, per key (``master``, Adam's moments), a
    ``[M, per-rank elements]`` tensor whose row ``r`` is rank ``r``'s partition."""

    names: list[str]
    tensors: dict[str, torch.Tensor]


def write_zero3(index: SourceIndex, reader: Reader, manifest: dict, module: dict,
                members: list[list[str]], tag_dir: str, world: int) -> list[str]:
    """Write the stage 3 files of a tag into the (temporary) folder ``tag_dir`` (Note
    above); ``members`` are each optimizer group's trainable parameters in flattening
    order. Returns the paths written."""
    empty = {n for names in members for n in names if module[n].numel() == 0}
    members = [[n for n in names if n not in empty] for names in members]
    trainable = {n for names in members for n in names}
    frozen_set = {e["name"] for e in manifest["frozen"]} | empty
    frozen = [n for n in module if n in frozen_set]         # the module's order
    params = frozen_set | trainable
    groups, steps = [], []
    for names in members:
        keys, step = group_state(index, names)
        groups.append([_sub_group(index, reader, module, sub, keys, world)
                       for sub in _split(names, [_chunk(module[n], world) for n in names])])
        steps.append(step)
    base = model_states(manifest, module, [], world)
    base["param_shapes"] = [OrderedDict((n, torch.Size(module[n].shape)) for n in g.names)
                            for subs in groups for g in subs]
    base["frozen_param_shapes"] = OrderedDict((n, torch.Size(module[n].shape)) for n in frozen)
    base["module"] = OrderedDict(
        (n, torch.empty(0, dtype=t.dtype) if n in params else t)
        for n, t in module.items())
    scaler = _loss_scaler(manifest.get("loss_scaler"))
    written = []
    for rank in range(world):
        states = {**base, "frozen_param_fragments": OrderedDict(
            (n, _chunks(module[n].reshape(-1).float(), world)[rank].clone()) for n in frozen)}
        prefix = os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_")
        written.append(save_file(states, prefix + "model_states.pt", pickler=True))
        optim = _optim_states(manifest["optimizer"]["param_groups"], groups, steps, rank,
                              world, scaler)
        written.append(save_file(optim, prefix + "optim_states.pt", pickler=True))
    return written


def _chunk(tensor: torch.Tensor, world: int) -> int:
    return math.ceil(tensor.numel() / world)


def _chunks(flat: torch.Tensor, world: int) -> torch.Tensor:
    """``[M, c]``: row ``r`` is rank ``r``'s chunk of ``flat``, zero-padded."""
    chunk = _chunk(flat, world)
    out = torch.zeros(world * chunk, dtype=flat.dtype)
    out[:flat.numel()].copy_(flat)
    return out.view(world, chunk)


def _split(names: list[str], chunks: list[int]) -> list[list[str]]:
    """DeepSpeed's ``_create_fp16_sub_groups``: one sub-group unless the group's per-rank
    elements exceed ``SUB_GROUP_SIZE``; then a new one after each parameter that brings
    the running count to it."""
    if SUB_GROUP_SIZE >= sum(chunks):
        return [names] if names else []
    out, current, size = [], [], 0
    for name, chunk in zip(names, chunks):
        current.append(name)
        size += chunk
        if size >= SUB_GROUP_SIZE or name == names[-1]:
            out.append(current)
            current, size = [], 0
    return out


def _sub_group(index: SourceIndex, reader: Reader, module: dict, names: list[str],
               keys: list[str], world: int) -> _SubGroup:
    chunks = [_chunk(module[n], world) for n in names]
    tensors = {key: torch.zeros(world, sum(chunks), dtype=torch.float32)
               for key in ["master", *keys]}
    offset = 0
    for name, chunk in zip(names, chunks):
        numel = module[name].numel()
        full = torch.zeros(world * chunk, dtype=torch.float32)
        for key in tensors:
            if key == "master":
                full[:numel].copy_(module[name].reshape(-1))
            else:
                index.read_into(reader, name, key, 0, numel, full[:numel])
            tensors[key][:, offset:offset + chunk].copy_(full.view(world, chunk))
        offset += chunk
    return _SubGroup(names, tensors)


def _optim_states(saved_groups: list[dict], groups: list[list[_SubGroup]],
                  steps: list[Optional[float]], rank: int, world: int, scaler: Any) -> dict:
    state, param_groups, flats = {}, [], []
    for saved, subs, step in zip(saved_groups, groups, steps):
        ids = []
        for sub in subs:
            part = {k: v[rank].clone() for k, v in sub.tensors.items()}
            flats.append(part.pop("master"))
            if part:
                state[len(flats) - 1] = ({} if step is None else {
                    "step": torch.tensor(step, dtype=torch.float32)}) | part
            ids.append(len(flats) - 1)
        param_groups.append({**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in saved.items()}, "params": ids})
    return {"optimizer_state_dict": {
        "zero_stage": 3,
        "loss_scaler": scaler,
        "dynamic_loss_scale": bool(getattr(scaler, "state", {}).get("dynamic", False)),
        "overflow": False,
        "partition_count": world,
        "optimizer_state_dict": {"state": state, "param_groups": param_groups},
        "fp32_flat_groups": flats,
        "ds_version": DS_VERSION}, "ds_version": DS_VERSION}


def _loss_scaler(state: Optional[dict]) -> DeepSpeedObject:
    """DeepSpeed's loss scaler for zerotrain's ``LossScaler.state_dict()`` (None: fp32 and
    bf16, DeepSpeed's static scale of 1): the inverse of the import's mapping."""
    root = "deepspeed.runtime.fp16.loss_scaler."
    if not state or not state.get("dynamic"):
        scale = float(state.get("loss_scale", 1.0)) if state else 1.0
        return DeepSpeedObject(root + "LossScaler", {"cur_scale": scale, "dynamic": False})
    return DeepSpeedObject(root + "DynamicLossScaler", {
        "cur_scale": float(state["loss_scale"]), "dynamic": True,
        "cur_iter": int(state.get("cur_iter", 0)),
        "last_overflow_iter": int(state.get("last_overflow_iter", -1)),
        "scale_factor": float(state.get("scale_factor", 2.0)),
        "scale_window": int(state["scale_window"]), "min_scale": float(state["min_scale"]),
        "delayed_shift": int(state["hysteresis"]),
        "cur_hysteresis": int(state.get("cur_hysteresis", state["hysteresis"])),
        "consecutive_hysteresis": bool(state.get("consecutive_hysteresis", False)),
        "raise_error_at_min_scale": True, "dtype": torch.float16})
