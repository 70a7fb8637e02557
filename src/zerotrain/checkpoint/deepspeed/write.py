"""A zerotrain checkpoint as a DeepSpeed ZeRO checkpoint for a chosen world size: stages 1-2
here, stage 3 in ``write3.py``.

Note: what DeepSpeed 0.19's loader needs
    ``mp_rank_00_model_states.pt``: the module's state dict (fp32), ``param_shapes`` (per
    optimizer group, name -> shape, in flattening order), the counters, ``lr_scheduler``,
    ``dp_world_size``. One ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank of the
    target world ``M``: DeepSpeed flattens each group in ``param_shapes`` order, pads it to a
    multiple of ``2*M`` elements (``nccl_start_alignment_factor * M``) and gives rank ``r``
    partition ``[r*P, (r+1)*P)``; the file holds that fp32 partition
    (``single_partition_of_fp32_groups``) and the base optimizer's ``state_dict()`` over the
    partitions (the "rigid" form: Adam's moments as partitions, ``step``, the group
    hyperparameters), ``group_paddings`` (the last rank's padding), and a ``ds_version``
    its loader checks. DeepSpeed's own class instances (loss scaler, ``zero_stage``, slice
    mappings) are left out: its loader keeps its configured ones when they are missing, so
    the files hold only tensors, dicts, lists and numbers (``torch.load(weights_only=True)``
    reads them), and DeepSpeed need not be installed to write them.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Optional

import torch

from ...core.records import FROZEN
from ..consolidate import export_specs, read_full, resolve_checkpoint
from ..fs import write_latest
from ..manifest import CheckpointError, file_identity_check, read_manifest
from ..reshard import SourceIndex
from ..stfile import Reader

DS_VERSION = "0.19.8"
ALIGNMENT_FACTOR = 2   # DeepSpeed's nccl_start_alignment_factor


def export_deepspeed(checkpoint_dir: str, output_dir: str, *, stage: int, world_size: int,
                     tag: Optional[str] = None) -> list[str]:
    """Write zerotrain checkpoint ``checkpoint_dir`` as a DeepSpeed ZeRO-``stage`` save
    directory for ``world_size`` data-parallel ranks: ``output_dir/latest`` and
    ``output_dir/global_step<N>/``. Returns the files written."""
    if stage not in (1, 2, 3):
        raise CheckpointError(f"--stage {stage}: DeepSpeed checkpoints of stages 1, 2 and 3 "
                              "are written")
    if world_size < 1:
        raise CheckpointError(f"--world-size must be at least 1, got {world_size}")
    path = resolve_checkpoint(checkpoint_dir, tag)
    manifest = read_manifest(path)
    index = SourceIndex(manifest)
    saved_groups = manifest["optimizer"]["param_groups"]
    members = group_members(manifest)
    with Reader(path, on_open=file_identity_check(manifest, path)) as reader:
        module = OrderedDict((spec.key, read_full(index, reader, spec))
                             for spec in export_specs(manifest))
        if stage == 3:
            from .write3 import write_zero3
            return write_zero3(index, reader, manifest, module, members, output_dir,
                               world_size)
        flats = [_flat_group(index, reader, module, names, world_size) for names in members]
    counters = manifest["counters"]
    out_tag = f"global_step{counters['global_steps']}"
    tag_dir = os.path.join(output_dir, out_tag)
    os.makedirs(tag_dir, exist_ok=True)
    written = [save_file(model_states(manifest, module, members, world_size),
                     os.path.join(tag_dir, "mp_rank_00_model_states.pt"))]
    for rank in range(world_size):
        written.append(save_file(_optim_states(saved_groups, flats, rank, world_size),
                             os.path.join(tag_dir,
                                          f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")))
    write_latest(output_dir, out_tag, "deepspeed")
    return written + [os.path.join(output_dir, "latest")]


def group_members(manifest: dict) -> list[list[str]]:
    """Each optimizer group's parameter names in the module's order: the order DeepSpeed
    flattens a group in (``param_shapes``)."""
    order = {n: i for i, n in enumerate(manifest.get("state_dict_order", []))}
    groups: dict[int, list[str]] = {}
    for record in manifest["records"]:
        if record["group_index"] != FROZEN:
            groups.setdefault(record["group_index"], []).extend(record["names"])
    return [sorted(groups.get(g, []), key=lambda n: order.get(n, len(order)))
            for g in range(len(manifest["optimizer"]["param_groups"]))]


def _flat_group(index: SourceIndex, reader: Reader, module: dict, names: list[str],
                world: int) -> dict:
    """One optimizer group flattened DeepSpeed's way: ``{key: padded flat tensor}``, the
    partition size, the padding and the step."""
    total = sum(module[n].numel() for n in names)
    alignment = ALIGNMENT_FACTOR * world
    padded = int(math.ceil(total / alignment)) * alignment if total else alignment
    keys, step = group_state(index, names)
    out = {key: torch.zeros(padded, dtype=torch.float32) for key in ["master", *keys]}
    cursor = 0
    for name in names:
        numel = module[name].numel()
        out["master"][cursor:cursor + numel].copy_(module[name].reshape(-1).float())
        for key in keys:
            index.read_into(reader, name, key, 0, numel, out[key][cursor:cursor + numel])
        cursor += numel
    return {"tensors": out, "names": names, "partition": padded // world, "padding": padded - total,
            "step": step}


def group_state(index: SourceIndex, names: list[str]) -> tuple[list[str], Optional[float]]:
    """The optimizer state keys and the Adam step of one group's parameters, which DeepSpeed
    keeps once per group (raises naming the parameter or the steps that differ)."""
    records = [index.params[n].record for n in names]
    keys = list(records[0]["state_tensors"]) if records else []
    for name, record in zip(names, records):
        if list(record["state_tensors"]) != keys:
            raise CheckpointError(f"parameter {name!r} has optimizer state "
                                  f"{record['state_tensors']}, others of its group {keys}")
    steps = {float(r["state_scalars"]["step"]["value"]) for r in records
             if "step" in r["state_scalars"]}
    if len(steps) > 1:
        raise CheckpointError(f"the parameters of one optimizer group have different Adam "
                              f"steps {sorted(steps)}; DeepSpeed keeps one per group")
    return keys, (steps.pop() if steps else None)


def model_states(manifest: dict, module: dict, members: list[list[str]], world: int) -> dict:
    """DeepSpeed's model-states dict: ``module`` as given, shapes from the manifest."""
    in_groups = {n for names in members for n in names}
    shapes = {n: s for r in manifest["records"] for n, s in zip(r["names"], r["shapes"])}
    buffers = [e["name"] for e in manifest["buffers"]]
    frozen = [e for e in manifest["frozen"]]
    counters = manifest["counters"]
    states = {
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(shapes[n])) for n in names)
                         for names in members],
        "frozen_param_shapes": OrderedDict((e["name"], torch.Size(e["shape"])) for e in frozen
                                           if e["name"] not in in_groups),
        "shared_params": {},
        "frozen_param_fragments": OrderedDict(),
        "lr_scheduler": manifest.get("lr_scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(counters["skipped_steps"]),
        "global_steps": int(counters["global_steps"]),
        "global_samples": int(counters["global_samples"]),
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_version": DS_VERSION,
    }
    client = manifest.get("client_state") or {}
    if isinstance(client, dict) and not manifest.get("client_state_file"):
        states.update({k: v for k, v in client.items() if k not in states})
    return states


def _optim_states(saved_groups: list[dict], flats: list[dict], rank: int, world: int) -> dict:
    state, groups, partitions = {}, [], []
    for g, (saved, flat) in enumerate(zip(saved_groups, flats)):
        size = flat["partition"]
        part = {k: v[rank * size:(rank + 1) * size].clone() for k, v in flat["tensors"].items()}
        partitions.append(part.pop("master"))
        if flat["step"] is not None:
            part = {"step": torch.tensor(flat["step"], dtype=torch.float32), **part}
        state[g] = part
        groups.append({**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()},
                       "params": [g]})
    return {"optimizer_state_dict": {
        "dynamic_loss_scale": False,
        "overflow": False,
        "base_optimizer_state": {"state": state, "param_groups": groups},
        "single_partition_of_fp32_groups": partitions,
        "group_paddings": [f["padding"] if rank == world - 1 else 0 for f in flats],
        "param_alignment_paddings": [[0] * len(p) for p in _shapes(flats)],
        "partition_count": [world] * len(flats),
        "ds_version": DS_VERSION}, "ds_version": DS_VERSION}


def _shapes(flats: list[dict]) -> list[list]:
    return [f["names"] for f in flats]


def save_file(value: dict, path: str, *, pickler: bool = False) -> str:
    """``torch.save`` with a named error; ``pickler``: through ``write3``'s pickler, which
    writes DeepSpeed's loss scaler by class name."""
    try:
        if pickler:
            from .write3 import PICKLE_MODULE
            torch.save(value, path, pickle_module=PICKLE_MODULE)
        else:
            torch.save(value, path)
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path
