"""A zerotrain checkpoint as a torch DCP checkpoint that FSDP2 loads at any world size.

The folder holds ``{"model": {name: fp32 weight}, "optimizer": {"state": {name: {"step",
"exp_avg", ...}}, "param_groups": [...]}}``, the layout of
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` keyed as
``dcp.save({"model": ..., "optimizer": ...})``: an FSDP2 job loads it with ``dcp.load`` into
its own (sharded) state dicts and ``set_state_dict``, whatever its world size, because every
tensor is saved whole (DCP reads each rank's part of it). Written by torch's own
``dcp.save`` (no process group needed), so the files are DCP's format, ``.metadata``
pickled as DCP does. The whole state is held in memory while it is written.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ...core.records import FROZEN
from ..consolidate import export_specs, read_full, resolve_checkpoint
from ..manifest import CheckpointError, file_identity_check, read_manifest
from ..reshard import SourceIndex
from ..stfile import Reader


def export_dcp(checkpoint_dir: str, output_dir: str, tag: Optional[str] = None) -> list[str]:
    """Write the zerotrain checkpoint ``checkpoint_dir`` (tag ``tag``, default ``latest``) as
    a DCP folder ``output_dir``; returns the files written."""
    import torch.distributed.checkpoint as dcp

    path = resolve_checkpoint(checkpoint_dir, tag)
    manifest = read_manifest(path)
    index = SourceIndex(manifest)
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    members: dict[int, list[str]] = {}
    with Reader(path, on_open=file_identity_check(manifest, path)) as reader:
        for spec in export_specs(manifest):
            model[spec.key] = read_full(index, reader, spec)
        for name, source in index.params.items():
            record = source.record
            if record["group_index"] == FROZEN:
                continue
            members.setdefault(record["group_index"], []).append(name)
            shape = model[name].shape
            entry: dict[str, torch.Tensor] = {}
            step = record["state_scalars"].get("step")
            if step is not None:
                entry["step"] = torch.tensor(float(step["value"]), dtype=torch.float32)
            for key in record["state_tensors"]:
                out = torch.empty(shape.numel(), dtype=torch.float32)
                index.read_into(reader, name, key, 0, shape.numel(), out)
                entry[key] = out.view(shape)
            if entry:
                state[name] = entry
    order = {name: i for i, name in enumerate(manifest.get("state_dict_order", []))}
    groups = []
    for i, saved in enumerate(manifest["optimizer"]["param_groups"]):
        group = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
        group["params"] = sorted(members.get(i, []), key=lambda n: order.get(n, len(order)))
        groups.append(group)
    try:
        os.makedirs(output_dir, exist_ok=True)
        if os.listdir(output_dir):
            raise CheckpointError(f"{output_dir} is not empty; a DCP export needs an empty "
                                  "directory")
        dcp.save({"model": model, "optimizer": {"state": state, "param_groups": groups}},
                 storage_writer=dcp.FileSystemWriter(output_dir), no_dist=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write {output_dir}: {exc.strerror or exc}") from None
    return sorted(os.path.join(output_dir, n) for n in os.listdir(output_dir))
