"""Full fp32 weights from a sharded checkpoint, without a process group.

Each parameter is rebuilt from the fp32 master chunks spread over the rank files (the same
range arithmetic as resharding, Note: element ranges in ``reshard.py``), one parameter at a
time, so memory never holds more than the largest parameter (plus, for
:func:`get_fp32_state_dict_from_zero_checkpoint`, the dict it returns). Frozen parameters
and floating buffers are returned in fp32, integer buffers as they are.

:func:`convert_zero_checkpoint_to_fp32_state_dict` writes the Hugging Face layout:
``model-0000k-of-0000N.safetensors`` files of at most ``max_shard_size`` bytes each (a
larger tensor gets a file of its own), ``model.safetensors.index.json`` mapping every name
to its file, and ``config.json`` when the manifest recorded the model's config. An
``output_dir`` ending in ``.safetensors`` gets one file instead.

A DeepSpeed ZeRO checkpoint (recognised by ``deepspeed.find_tag_dir``) is read by
``deepspeed.DeepSpeedExport`` and written the same way. The output is written aside and
renamed in whole, never inside the checkpoint it reads (Note: exports write like saves, in
``export_target.py``).

DeepSpeed's file finders of this module (``get_model_state_file``, ``get_optim_files``...)
live in ``deepspeed/file_names.py``; for a zerotrain save they answer with stand-ins
(Note there).
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Callable, Iterator, Optional, Union

import torch

from . import fs
from .deepspeed import DeepSpeedExport, find_tag_dir
from .export_target import replacing_file, replacing_folder
from .deepspeed.file_names import (get_checkpoint_files, get_model_state_file,  # noqa: F401
                                   get_model_state_files, get_optim_files)      # DeepSpeed's
from .manifest import MANIFEST_NAME, CheckpointError, file_identity_check, read_manifest
from .reshard import SourceIndex
from .stfile import DTYPES_BY_NAME, Reader, TensorSpec, write_file

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def resolve_checkpoint(checkpoint_dir: str, tag: Optional[str] = None) -> str:
    """The tag directory: ``checkpoint_dir/tag``, the one ``latest`` names, or
    ``checkpoint_dir`` itself when it already is a tag directory."""
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, MANIFEST_NAME)):
        return checkpoint_dir
    if tag is None:
        tag = fs.read_latest(checkpoint_dir)
        if tag is None:
            raise CheckpointError(f"{checkpoint_dir} has no 'latest' file and no "
                                  f"{MANIFEST_NAME}; pass tag=")
    found = fs.tag_dir(checkpoint_dir, tag)
    if found is None:
        raise CheckpointError(f"checkpoint tag {tag!r} was not found in {checkpoint_dir}")
    return found


def export_specs(manifest: dict) -> list[TensorSpec]:
    """Name, dtype and shape of every exported tensor, in the module's state-dict order."""
    specs: dict[str, TensorSpec] = {}
    for record in manifest["records"]:
        for name, shape in zip(record["names"], record["shapes"]):
            specs[name] = TensorSpec(name, torch.float32, tuple(shape))
    for entry in manifest["frozen"] + manifest["buffers"]:
        dtype = DTYPES_BY_NAME.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{entry['name']!r} has unsupported dtype {entry['dtype']!r}")
        specs[entry["name"]] = TensorSpec(entry["name"], torch.float32 if dtype.is_floating_point
                                          else dtype, tuple(entry["shape"]))
    left_out = [e["name"] for e in manifest.get("excluded_frozen", [])]
    if left_out:   # Note "frozen parameters left out" in save.py
        logger.warning("the checkpoint was saved with exclude_frozen_parameters=True: %d "
                       "frozen parameter(s) are not in it and not exported (%s)",
                       len(left_out), ", ".join(left_out[:5]) + (", ..." if
                                                                 len(left_out) > 5 else ""))
    order = [n for n in manifest.get("state_dict_order", []) if n in specs]
    order += [n for n in specs if n not in set(order)]
    return [specs[n] for n in dict.fromkeys(order)]


def read_full(index: SourceIndex, reader: Reader, spec: TensorSpec) -> torch.Tensor:
    """One exported tensor, whole, in ``spec.dtype``."""
    if spec.key in index.params:
        source = index.params[spec.key]
        record = source.record
        for filename in record["files"]:   # the files hold what the manifest claims: check
            reader.check(filename, f"{record['key']}/master", torch.float32,   # before the
                         (record["shard_numel"],))                             # allocation
        numel = source.slot.numel
        out = torch.empty(numel, dtype=torch.float32)
        index.read_into(reader, spec.key, "master", 0, numel, out)
        return out.view(spec.shape)
    return index.read_module(reader, spec.key).to(spec.dtype)


def iter_fp32_tensors(checkpoint_dir: str, tag: Optional[str] = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter and buffer, one at a time."""
    deepspeed_path = find_tag_dir(checkpoint_dir, tag, accept_tag_dir=True)
    if deepspeed_path is not None:
        yield from DeepSpeedExport(deepspeed_path).tensors()
        return
    path = resolve_checkpoint(checkpoint_dir, tag)
    manifest = read_manifest(path)
    index = SourceIndex(manifest)
    with Reader(path, on_open=file_identity_check(manifest, path)) as reader:
        for spec in export_specs(manifest):
            yield spec.key, read_full(index, reader, spec)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str,
                                             tag: Optional[str] = None) -> dict:
    """``{name: fp32 tensor}`` of the whole model (frozen parameters and buffers included),
    as DeepSpeed's function of the same name. Needs no process group."""
    return dict(iter_fp32_tensors(checkpoint_dir, tag))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: Optional[str] = None) -> torch.nn.Module:
    """DeepSpeed's function of the same name: the model, moved to the CPU, with the
    checkpoint's full fp32 weights loaded (``strict=False``, as DeepSpeed loads them)."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def parse_size(size: Union[int, str]) -> int:
    """``"5GB"`` -> 5 * 10**9 bytes, ``"2GiB"`` -> 2 * 2**30 (Hugging Face's convention)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if not match:
            raise CheckpointError(f"max_shard_size {size!r} is not a size like '5GB' or "
                                  "'500MiB'")
        value = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if value < 1:
        raise CheckpointError(f"max_shard_size must be positive, got {size!r}")
    return value


def plan_shards(specs: list[TensorSpec], limit: int) -> list[list[TensorSpec]]:
    """Consecutive tensors into files of at most ``limit`` bytes (a bigger tensor alone)."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if shards and size + spec.nbytes <= limit:
            shards[-1].append(spec)
            size += spec.nbytes
        else:
            shards.append([spec])
            size = spec.nbytes
    return shards


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               tag: Optional[str] = None,
                                               max_shard_size: Union[int, str] = "5GB"
                                               ) -> list[str]:
    """Write the model as fp32 safetensors shards in the Hugging Face layout (one file when
    ``output_dir`` ends in ``.safetensors``); a zerotrain or a DeepSpeed ZeRO checkpoint.

    Streams one tensor at a time. Returns the paths written (shards, index, config).
    """
    deepspeed_path = find_tag_dir(checkpoint_dir, tag, accept_tag_dir=True)
    if deepspeed_path is not None:
        source = DeepSpeedExport(deepspeed_path)
        return write_hf(source.specs(), source.read, output_dir, max_shard_size,
                        hf_config=source.hf_config(), source=deepspeed_path)
    path = resolve_checkpoint(checkpoint_dir, tag)
    manifest = read_manifest(path)
    index = SourceIndex(manifest)
    with Reader(path, on_open=file_identity_check(manifest, path)) as reader:
        return write_hf(export_specs(manifest), lambda spec: read_full(index, reader, spec),
                        output_dir, max_shard_size, hf_config=manifest.get("hf_config"),
                        source=path)


def write_hf(specs: list[TensorSpec], produce: Callable[[TensorSpec], torch.Tensor],
             output_dir: str, max_shard_size: Union[int, str] = "5GB", *,
             hf_config: Optional[dict] = None, source: str) -> list[str]:
    """Write ``specs`` (each made by ``produce``, one alive at a time) as Hugging Face
    shards plus index and ``config.json``, or as one file when ``output_dir`` ends in
    ``.safetensors``; written aside and renamed in whole, never inside ``source`` (Note:
    exports write like saves, in ``export_target.py``)."""
    if output_dir.endswith(".safetensors"):
        with replacing_file(source, output_dir) as tmp:
            write_file(tmp, specs, produce, metadata={"format": "pt"})
        return [output_dir]
    shards = plan_shards(specs, parse_size(max_shard_size))
    names, weight_map = [], {}
    with replacing_folder(source, output_dir, _hf_owned, "Hugging Face") as tmp:
        for i, shard in enumerate(shards):
            filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_file(os.path.join(tmp, filename), shard, produce, metadata={"format": "pt"})
            weight_map.update({spec.key: filename for spec in shard})
            names.append(filename)
        index_json = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                      "weight_map": weight_map}
        names.append(_write_json(tmp, INDEX_NAME, index_json))
        if hf_config:
            names.append(_write_json(tmp, "config.json", hf_config))
    return [os.path.join(output_dir, name) for name in names]


def _hf_owned(name: str) -> bool:
    """A file a Hugging Face export writes (an earlier export's may be replaced)."""
    return name in (INDEX_NAME, "config.json") or re.fullmatch(
        r"model-\d{5}-of-\d{5}\.safetensors", name) is not None


def _write_json(folder: str, name: str, value: dict) -> str:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    return name
