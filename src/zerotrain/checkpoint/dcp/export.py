"""A zerotrain checkpoint as a torch DCP checkpoint that FSDP2 loads at any world size.

The folder holds ``{"model": {name: fp32 weight}, "optimizer": {"state": {name: {"step",
"exp_avg", ...}}, "param_groups": [...]}}``: under ``model`` and ``optimizer`` the names,
shapes and dtypes that ``torch.distributed.checkpoint.state_dict``'s
``get_model_state_dict`` and ``get_optimizer_state_dict`` give for the model wrapped with
FSDP2's ``fully_shard`` (parameters and Adam moments by their full shape, a float32
``step`` per parameter, ``param_groups`` with every hyperparameter of the optimizer and
``params`` as parameter names). An FSDP2 job loads it with ``dcp.load`` into its own
(sharded) state dicts and ``set_model_state_dict`` / ``set_optimizer_state_dict``, whatever
its world size, because every tensor is saved whole (DCP reads each rank's part of it).
Written by torch's own ``dcp.save`` (no process group needed), so the files are DCP's
format, ``.metadata`` pickled as DCP does. The whole state is held in memory while it is
written; the folder is written aside and renamed in (Note: exports write like saves, in
``export_target.py``).

Note: the optimizer's two names
    What the optimizer's state dict is called at the top is the saving code's choice:
    torchtitan and Accelerate use ``optimizer``, others ``optim`` (as torch's DCP recipe
    names it beside ``model``). The bytes
    are written once, under ``optimizer``; ``.metadata`` also lists each of them under
    ``optim`` (the same file, offset and length), so ``dcp.load`` finds either name.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from ...core.records import FROZEN
from ..consolidate import export_specs, read_full, resolve_checkpoint
from ..export_target import check_apart, replacing_folder
from ..manifest import file_identity_check, read_manifest
from ..reshard import SourceIndex
from ..stfile import Reader

OPTIMIZER_KEY = "optimizer"   # torchtitan's and Accelerate's name for it
ALIAS_KEY = "optim"           # the name torch's DCP recipe gives it beside "model"


def export_dcp(checkpoint_dir: str, output_dir: str, tag: Optional[str] = None) -> list[str]:
    """Write the zerotrain checkpoint ``checkpoint_dir`` (tag ``tag``, default ``latest``) as
    a DCP folder ``output_dir``; returns the files written."""
    import torch.distributed.checkpoint as dcp

    path = resolve_checkpoint(checkpoint_dir, tag)
    check_apart(path, output_dir)
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
    state_dict = {"model": model, OPTIMIZER_KEY: {"state": state, "param_groups": groups}}
    with replacing_folder(path, output_dir, _dcp_owned, "torch DCP") as tmp:
        dcp.save(state_dict, storage_writer=_aliasing_writer(tmp), no_dist=True)
        names = sorted(os.listdir(tmp))
    return [os.path.join(output_dir, n) for n in names]


def _dcp_owned(name: str) -> bool:
    """A file a DCP save writes (an earlier export's may be replaced)."""
    return name == ".metadata" or name.endswith(".distcp")


def _aliasing_writer(path: str):
    """torch's ``FileSystemWriter`` for ``path`` that also lists every ``optimizer.*``
    entry under ``optim.*`` in ``.metadata``, pointing at the same bytes (Note: the
    optimizer's two names)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class AliasingWriter(FileSystemWriter):
        def finish(self, metadata, results) -> None:
            super().finish(metadata, [*results, _aliases(metadata, results)])

    return AliasingWriter(path)


def _aliases(metadata, results) -> list:
    """Add the ``optim.`` names to ``metadata`` (entries, planner paths); returns the
    storage records for them (the same files, offsets and lengths)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    prefix = OPTIMIZER_KEY + "."
    renamed = {fqn: ALIAS_KEY + fqn[len(OPTIMIZER_KEY):]
               for fqn in metadata.state_dict_metadata if fqn.startswith(prefix)}
    for fqn, alias in renamed.items():
        metadata.state_dict_metadata[alias] = metadata.state_dict_metadata[fqn]
        if metadata.planner_data is not None and fqn in metadata.planner_data:
            path = metadata.planner_data[fqn]
            metadata.planner_data[alias] = (ALIAS_KEY, *path[1:])
    return [dataclasses.replace(wr, index=MetadataIndex(renamed[wr.index.fqn],
                                                        wr.index.offset, wr.index.index))
            for wrs in results for wr in wrs if wr.index.fqn in renamed]
