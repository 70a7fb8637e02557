"""``deepspeed.checkpoint.utils``: DeepSpeed's checkpoint file names and tensor cloning.

Accelerate's ``get_state_dict`` imports ``clone_tensors_for_torch_save`` from here; the name
helpers build the file names DeepSpeed writes inside a tag folder (``mp_rank_00_model_states.pt``,
``zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt``, ``<layer>-model_<tp>_model_states.pt``),
the names :mod:`zerotrain.checkpoint.deepspeed` reads.
"""
from __future__ import annotations

import os
import re
from typing import Any, Union

import torch

__all__ = ["MODEL_FILE_PREFIX", "MODEL_FILE_SUFFIX", "OPTIM_FILE_SUFFIX", "ZERO_FILE_PREFIX",
           "atoi", "clone_tensors_for_torch_save", "get_layer_ckpt_name_for_rank",
           "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank", "natural_keys"]

MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"


def atoi(text: str) -> Union[int, str]:
    """A digit run as an int, anything else unchanged (a natural-sort key part)."""
    return int(text) if text.isdigit() else text


def natural_keys(text: str) -> list:
    """Sort key putting ``global_step10`` after ``global_step9``."""
    return [atoi(part) for part in re.split(r"(\d+)", text)]


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """``<base>/mp_rank_<mp_rank_str>_model_states.pt`` (``mp_rank_str`` already padded)."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """``<base>/zero_pp_rank_<dp>_mp_rank_<mp:02d>_optim_states.pt``."""
    return os.path.join(base_folder, f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}"
                                     f"{mp_rank:02d}{OPTIM_FILE_SUFFIX}")


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """``<base>/<layer_id>-model_<tp:02d>_model_states.pt`` (pipeline layer files)."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item: Any, device: Union[str, torch.device] = "cpu") -> Any:
    """``item`` with every tensor (nested in lists, tuples, dicts) detached and copied to
    ``device``: a view saved by ``torch.save`` would otherwise drag its whole flat buffer's
    storage into the file."""
    if torch.is_tensor(item):
        device = torch.device(device)
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
