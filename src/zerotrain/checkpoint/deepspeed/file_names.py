"""``deepspeed.utils.zero_to_fp32``'s file finders: ``get_model_state_file``,
``get_optim_files``, ``get_model_state_files``, ``get_checkpoint_files``.

Libraries call them to open a tag's files themselves: Lightning's
``convert_zero_checkpoint_to_fp32_state_dict`` reads ``zero_stage`` from the first optimizer
file and the script's own state (epoch, loops, callbacks) from the model-states file, with
``torch.load``. For a DeepSpeed tag folder they behave as DeepSpeed's: the sorted
(natural order) files matching the pattern, or ``FileNotFoundError`` naming the folder or
the file.

Note: a zerotrain tag's stand-ins
    A zerotrain save keeps its weights and optimizer state in safetensors files and has no
    optimizer ``.pt`` files (and at stage 3 no model-states file). Asked for what it lacks,
    these functions answer with stand-ins built from its manifest and written to a private
    temporary folder (removed when the process exits; nothing is written into the
    checkpoint): one ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per saved rank holding
    DeepSpeed's description of the save (``optimizer_state_dict.zero_stage`` and
    ``partition_count``, ``ds_version``) but no optimizer tensors, and the model-states file
    DeepSpeed writes (counters, shapes, ``ds_version``, the script's ``client_state`` at the
    top level) without module weights, as DeepSpeed's stage-3 file has none. The fp32
    weights come from ``get_fp32_state_dict_from_zero_checkpoint``; a full DeepSpeed copy
    of a save, optimizer state included, is ``zerotrain consolidate --to deepspeed``. The
    stand-ins hold only dicts, lists, numbers, strings and the client state's tensors.
"""
from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import tempfile
from typing import Optional

import torch

from .. import client_state
from ..manifest import MANIFEST_NAME, read_manifest
from .write_common import DS_VERSION, group_members, model_states

__all__ = ["get_checkpoint_files", "get_model_state_file", "get_model_state_files",
           "get_optim_files"]

# (zerotrain tag folder, its manifest's mtime and size) -> its stand-ins' folder: a tag
# saved again under the same name gets new ones
_views: dict[tuple[str, int, int], str] = {}
_root: Optional[str] = None


def _natural_keys(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir: str, glob_pattern: str) -> list[str]:
    """The files of ``checkpoint_dir`` matching ``glob_pattern``, in natural order."""
    found = glob.glob(os.path.join(checkpoint_dir, glob_pattern))
    if not found and _is_zerotrain_tag(checkpoint_dir):
        found = glob.glob(os.path.join(_stand_ins(checkpoint_dir), glob_pattern))
    if not found:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory "
                                f"'{checkpoint_dir}'")
    return sorted(found, key=_natural_keys)


def get_optim_files(checkpoint_dir: str) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_model_state_file(checkpoint_dir: str, zero_stage: int) -> str:
    """The model-states file DeepSpeed reads for ``zero_stage``: ``mp_rank_00_model_states.pt``
    at stages 0-2, ``zero_pp_rank_0_mp_rank_00_model_states.pt`` at stage 3."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    name = ("mp_rank_00_model_states.pt" if zero_stage <= 2
            else "zero_pp_rank_0_mp_rank_00_model_states.pt")
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path) and _is_zerotrain_tag(checkpoint_dir):
        path = os.path.join(_stand_ins(checkpoint_dir), name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at "
                                f"'{os.path.join(checkpoint_dir, name)}'")
    return path


def _is_zerotrain_tag(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def _stand_ins(tag_dir: str) -> str:
    """The folder of ``tag_dir``'s stand-in files, written on first use (Note above)."""
    global _root
    stat = os.stat(os.path.join(tag_dir, MANIFEST_NAME))
    key = (os.path.realpath(tag_dir), stat.st_mtime_ns, stat.st_size)
    if key in _views:
        return _views[key]
    manifest = read_manifest(tag_dir)
    if _root is None:
        _root = tempfile.mkdtemp(prefix="zerotrain-deepspeed-files-")
        atexit.register(shutil.rmtree, _root, True)
    folder = tempfile.mkdtemp(dir=_root)
    world, stage = int(manifest["world_size"]), int(manifest["stage"])
    states = model_states(manifest, {}, group_members(manifest), world)
    states["module"] = None
    states.update({k: v for k, v in client_state.load(manifest, tag_dir).items()
                   if k not in states})
    names = (["mp_rank_00_model_states.pt"] if stage <= 2 else
             [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)])
    for name in names:
        torch.save(states, os.path.join(folder, name))
    for rank in range(world):
        torch.save({"optimizer_state_dict": {"zero_stage": stage, "partition_count": world},
                    "ds_version": DS_VERSION},
                   os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    _views[key] = folder
    return folder
