"""Does a checkpoint fit this model? Checked on every rank before anything is read.

The first mismatch, in the model's parameter order, becomes the error: a parameter the
checkpoint lacks, one whose shape differs, or one the checkpoint has and the model does not.
Every rank holds the same manifest and the same model, so every rank raises the same error
before the first collective of the load.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
from torch import nn

from ..records import ShardRecord
from .manifest import CheckpointError

logger = logging.getLogger(__name__)


def model_shapes(module: nn.Module, records: Sequence[ShardRecord]) -> tuple[dict, dict]:
    """(parameter name -> shape, persistent buffer name -> shape), in module order.

    Shapes of trainable parameters come from the stage's records, which know the full
    shape even where the module holds only a shard of it.
    """
    params = {name: tuple(getattr(p, "ds_shape", p.shape))   # stage 3 keeps the full shape
              for name, p in module.named_parameters()}
    for record in records:
        for name, shape in zip(record.names, record.shapes):
            params[name] = tuple(shape)
    persistent = set(module.state_dict(keep_vars=True).keys())
    buffers = {name: tuple(b.shape) for name, b in module.named_buffers() if name in persistent}
    return params, buffers


def checkpoint_shapes(manifest: dict) -> tuple[dict, dict]:
    """(parameter name -> shape, buffer name -> shape) recorded in a manifest."""
    params = {}
    for record in manifest["records"]:
        for name, shape in zip(record["names"], record["shapes"]):
            params[name] = tuple(shape)
    for entry in manifest["frozen"]:
        params[entry["name"]] = tuple(entry["shape"])
    buffers = {entry["name"]: tuple(entry["shape"]) for entry in manifest["buffers"]}
    return params, buffers


def check_model(manifest: dict, module: nn.Module, records: Sequence[ShardRecord],
                path: str) -> None:
    """Raise CheckpointError naming the first parameter or buffer that does not match."""
    model_params, model_buffers = model_shapes(module, records)
    saved_params, saved_buffers = checkpoint_shapes(manifest)
    for kind, model, saved in (("parameter", model_params, saved_params),
                               ("buffer", model_buffers, saved_buffers)):
        for name, shape in model.items():
            if name not in saved:
                raise CheckpointError(f"{kind} {name!r} of the model is missing from "
                                      f"checkpoint {path}; was it saved from a different "
                                      "model?")
            if saved[name] != shape:
                raise CheckpointError(f"{kind} {name!r} has shape {shape} in the model but "
                                      f"{saved[name]} in checkpoint {path}")
        for name in saved:
            if name not in model:
                raise CheckpointError(f"checkpoint {path} has {kind} {name!r}, which the "
                                      "model does not have; was it saved from a different "
                                      "model?")


def check_groups(manifest: dict, param_groups: list, path: str) -> None:
    saved = manifest["optimizer"].get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(param_groups):
        count = len(saved) if isinstance(saved, list) else "no"
        raise CheckpointError(f"checkpoint {path} has {count} optimizer parameter groups, "
                              f"this optimizer has {len(param_groups)}; load with "
                              "load_optimizer_states=False to take only the weights")


_NON_NEGATIVE = ("lr", "weight_decay", "eps", "momentum", "dampening", "initial_lr")


def check_group_values(saved: list, param_groups: list, path: str) -> list[dict]:
    """The saved hyperparameters of each group, checked against the live optimizer's.

    Group membership (``params``) is the optimizer's, never the checkpoint's; every other
    key the live group has must hold the same kind of value (a number for a number or
    tensor, a list of as many numbers for a tuple such as ``betas``, a bool for a bool),
    be finite, and be non-negative where a learning rate, decay or epsilon must be, with
    ``betas`` in [0, 1). Raises CheckpointError naming ``param_groups[i].key``. Keys the
    live groups lack (another optimizer's) are left out with a warning.
    """
    checked = []
    for i, (group, live) in enumerate(zip(saved, param_groups)):
        where = f"checkpoint {path}: optimizer.param_groups[{i}]"
        if not isinstance(group, dict):
            raise CheckpointError(f"{where} is not a JSON object")
        if "params" in group:
            raise CheckpointError(f"{where}.params is set; which parameters a group holds "
                                  "comes from the model, not the checkpoint")
        unknown = sorted(k for k in group if k not in live)
        if unknown:
            logger.warning("%s: not restoring %s, which this optimizer does not have", where,
                           unknown)
        for key in group.keys() - set(unknown):
            _check_value(group[key], live[key], f"{where}.{key}", key)
        checked.append({k: v for k, v in group.items() if k not in unknown})
    return checked


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_value(value: Any, current: Any, where: str, key: str) -> None:
    """One saved hyperparameter against the live one (see :func:`check_group_values`)."""
    if current is None:   # an optional switch such as ``foreach`` or ``fused``
        if value is not None and not isinstance(value, bool):
            raise CheckpointError(f"{where} is {value!r}; expected null, true or false")
        return
    if isinstance(current, (bool, str)):
        if type(value) is not type(current):
            raise CheckpointError(f"{where} is {value!r}; this optimizer holds "
                                  f"{type(current).__name__} {current!r}")
        return
    if isinstance(current, (tuple, list)):
        if not isinstance(value, list) or len(value) != len(current) or not all(
                _number(v) and math.isfinite(v) for v in value):
            raise CheckpointError(f"{where} is {value!r}; expected {len(current)} finite "
                                  f"numbers like {list(current)!r}")
        if key == "betas" and not all(0 <= v < 1 for v in value):
            raise CheckpointError(f"{where} is {value!r}; betas must lie in [0, 1)")
        return
    if _number(current) or isinstance(current, torch.Tensor):
        if not _number(value) or not math.isfinite(value):
            raise CheckpointError(f"{where} is {value!r}; expected a finite number")
        if key in _NON_NEGATIVE and value < 0:
            raise CheckpointError(f"{where} is {value!r}; it must not be negative")
