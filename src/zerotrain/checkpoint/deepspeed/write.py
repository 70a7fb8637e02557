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
    hyperparameters), ``zero_stage``, ``partition_count``, ``group_paddings`` and a
    ``ds_version`` its loader checks. As DeepSpeed saves them, the fp32 partitions are
    "lean": the last rank's leaves out the group's padding (its ``group_paddings`` entry, 0
    on the other ranks), while Adam's moments keep the whole partition (DeepSpeed's loader
    pads the fp32 partition back and hands the moments to torch's ``load_state_dict`` as
    they are). DeepSpeed's ``zero_to_fp32`` concatenates the ranks' partitions and walks
    ``param_shapes`` through them, so the concatenation must be the group's elements,
    padded at most to the next multiple of ``2*M``. Each frozen parameter is also kept whole
    in ``frozen_param_fragments``, as DeepSpeed's stage 2 saves it (``zero_to_fp32`` reads
    frozen parameters from there). DeepSpeed's own class instances (loss scaler, slice
    mappings) are left out, as its loader keeps its configured ones when they are missing,
    and ``zero_stage`` is a plain int (DeepSpeed pickles its ``ZeroStageEnum``, an int
    enum); so the files hold only tensors, dicts, lists and numbers
    (``torch.load(weights_only=True)`` reads them), and DeepSpeed need not be installed to
    write them. The tag is written aside and published as a save publishes one (Note:
    exports write like saves, in ``export_target.py``).
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Optional

import torch

from ..consolidate import export_specs, read_full, resolve_checkpoint
from ..export_target import check_apart, publishing_tag
from ..manifest import CheckpointError, file_identity_check, read_manifest
from ..reshard import SourceIndex
from ..stfile import Reader
from .write3 import write_zero3
from .write_common import DS_VERSION, group_members, group_state, model_states, save_file

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
    check_apart(path, output_dir)
    manifest = read_manifest(path)
    index = SourceIndex(manifest)
    saved_groups = manifest["optimizer"]["param_groups"]
    members = group_members(manifest)
    out_tag = f"global_step{manifest['counters']['global_steps']}"
    with Reader(path, on_open=file_identity_check(manifest, path)) as reader:
        module = OrderedDict((spec.key, read_full(index, reader, spec))
                             for spec in export_specs(manifest))
        if stage == 3:
            with publishing_tag(path, output_dir, out_tag) as tag_dir:
                names = write_zero3(index, reader, manifest, module, members, tag_dir,
                                    world_size)
            return _written(output_dir, out_tag, names)
        flats = [_flat_group(index, reader, module, names, world_size) for names in members]
    states = model_states(manifest, module, members, world_size)
    with publishing_tag(path, output_dir, out_tag) as tag_dir:
        names = [save_file(states, os.path.join(tag_dir, "mp_rank_00_model_states.pt"))]
        for rank in range(world_size):
            names.append(save_file(_optim_states(saved_groups, flats, rank, world_size, stage),
                                   os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_"
                                                "optim_states.pt")))
    return _written(output_dir, out_tag, names)


def _written(output_dir: str, tag: str, paths: list[str]) -> list[str]:
    """The published paths of the files written into the tag's temporary folder."""
    return [os.path.join(output_dir, tag, os.path.basename(p)) for p in paths] + [
        os.path.join(output_dir, "latest")]


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


def _optim_states(saved_groups: list[dict], flats: list[dict], rank: int, world: int,
                  stage: int) -> dict:
    """Rank ``rank``'s optimizer-state file (Note: what DeepSpeed 0.19's loader needs)."""
    state, groups, partitions = {}, [], []
    for g, (saved, flat) in enumerate(zip(saved_groups, flats)):
        size = flat["partition"]
        part = {k: v[rank * size:(rank + 1) * size].clone() for k, v in flat["tensors"].items()}
        partitions.append(part.pop("master")[:size - _padding(flat, rank, world)].clone())
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
        "zero_stage": stage,
        "group_paddings": [_padding(f, rank, world) for f in flats],
        "param_alignment_paddings": [[0] * len(p) for p in _shapes(flats)],
        "partition_count": [world] * len(flats),
        "ds_version": DS_VERSION}, "ds_version": DS_VERSION}


def _padding(flat: dict, rank: int, world: int) -> int:
    """The padding DeepSpeed strips from rank ``rank``'s partition when it saves: the whole
    group padding on the last rank (at most its partition), none elsewhere."""
    return min(flat["padding"], flat["partition"]) if rank == world - 1 else 0


def _shapes(flats: list[dict]) -> list[list]:
    return [f["names"] for f in flats]


