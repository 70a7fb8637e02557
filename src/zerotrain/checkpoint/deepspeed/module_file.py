"""DeepSpeed's ``mp_rank_00_model_states.pt``, written beside a zerotrain save of stages 0-2.

Why: scripts written for DeepSpeed read the module's weights straight from that file after
a save (``torch.load(".../mp_rank_00_model_states.pt")["module"]``). Below stage 3 every
rank holds the whole module (tensor parallelism aside: there no file is written), so rank
0 writes it as DeepSpeed does, with no gather: the
module's ``state_dict()`` in its training dtype (frozen parameters left out with
``exclude_frozen_parameters``), ``param_shapes``, ``buffer_names``, the counters and
``dp_world_size`` (the fields of ``write.model_states``). At stage 3 DeepSpeed's per-rank
model files hold no weights, and none is written (``zerotrain consolidate --to deepspeed``
makes a whole DeepSpeed folder from any save).

The file holds only tensors, dicts, lists, numbers and strings, so
``torch.load(weights_only=True)`` reads it. zerotrain's loader never reads it: a tag with a
``manifest.json`` is zerotrain's (``files.is_deepspeed_tag_dir``), and its weights come from
the safetensors files.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch

from .files import MODEL_FILE
from .write_common import group_members, model_states, save_file

__all__ = ["MODEL_FILE", "live_module_state", "write_module_file"]


def live_module_state(module: torch.nn.Module, *, exclude_frozen_parameters: bool
                      ) -> "OrderedDict[str, torch.Tensor]":
    """What DeepSpeed's ``module_state_dict`` saves: ``module.state_dict()`` (an override on
    the module is honoured), less the parameters that need no gradient when
    ``exclude_frozen_parameters``; live tensors, detached."""
    state = module.state_dict()
    if exclude_frozen_parameters:
        for name, param in module.named_parameters():
            if not param.requires_grad:
                state.pop(name, None)
    return OrderedDict((k, v.detach()) for k, v in state.items())


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor owning exactly its elements: ``torch.save`` writes a view's whole
    storage, which for a view into a larger buffer would be that buffer."""
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    if tensor.device.type == "cpu" and whole and tensor.storage_offset() == 0:
        return tensor
    return tensor.to("cpu", copy=True).contiguous()


def write_module_file(tag_dir: str, manifest: dict, module: dict, world_size: int) -> int:
    """Write ``tag_dir/mp_rank_00_model_states.pt`` from the save's ``manifest`` and the
    module tensors :func:`live_module_state` gave; returns its size in bytes."""
    tensors = OrderedDict((k, _compact(v)) for k, v in module.items())
    states = model_states(manifest, tensors, group_members(manifest), world_size)
    path = save_file(states, os.path.join(tag_dir, MODEL_FILE))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return os.path.getsize(path)
