"""Does a checkpoint fit this model? Checked on every rank before anything is read.

The first mismatch, in the model's parameter order, becomes the error: a parameter the
checkpoint lacks, one whose shape differs, or one the checkpoint has and the model does not.
Every rank holds the same manifest and the same model, so every rank raises the same error
before the first collective of the load.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Container, Sequence

import torch
from torch import nn

from ..core.records import ShardRecord
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
    for entry in manifest["frozen"] + manifest.get("excluded_frozen", []):
        params[entry["name"]] = tuple(entry["shape"])
    buffers = {entry["name"]: tuple(entry["shape"]) for entry in manifest["buffers"]}
    return params, buffers


def check_model(saved: tuple[dict, dict], module: nn.Module, records: Sequence[ShardRecord],
                what: str, *, aliases: Container[str] = ()) -> None:
    """Raise CheckpointError naming the first parameter or buffer that does not match.
    ``saved``: the (parameter, buffer) name -> shape maps of the checkpoint ``what`` names;
    ``aliases``: tied names it may hold that the model does not list."""
    for kind, model, found in zip(("parameter", "buffer"), model_shapes(module, records), saved):
        for name, shape in model.items():
            if name not in found:
                raise CheckpointError(f"{kind} {name!r} of the model is missing from {what}; "
                                      "was it saved from a different model?")
            if tuple(found[name]) != shape:
                raise CheckpointError(f"{kind} {name!r} has shape {shape} in the model but "
                                      f"{tuple(found[name])} in {what}")
        for name in found:
            if name not in model and name not in aliases:
                raise CheckpointError(f"{what} has {kind} {name!r}, which the model does not "
                                      "have; was it saved from a different model?")


def check_left_out(manifest: dict, module: nn.Module, what: str) -> frozenset[str]:
    """The frozen parameters a save left out (``exclude_frozen_parameters``), which a load
    keeps as the model holds them; CheckpointError naming the first one that needs a
    gradient in this model (the checkpoint has no value for it)."""
    left_out = frozenset(e["name"] for e in manifest.get("excluded_frozen", []))
    for name, param in module.named_parameters():
        if name in left_out and param.requires_grad:
            raise CheckpointError(
                f"parameter {name!r} is trainable in the model but {what} has no value for "
                "it: it was frozen when saved with exclude_frozen_parameters=True; freeze "
                "it (requires_grad=False) before loading, or load a checkpoint saved "
                "without that argument")
    return left_out


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


# --------------------------------------------------------------------------- small state
# Note: small state is checked at staging
#     Both loaders (zerotrain's format and DeepSpeed's) pass the loss scaler, scheduler and
#     data-loader state through these checks before any rank agrees, so a value that would
#     divide by zero, skip every later step, or raise inside ``load_state_dict`` after the
#     tensors were committed is refused while nothing has changed yet.
_MAX_INT = 2 ** 62
_MAX_SCALE = 2.0 ** 64


def _kind_matches(value: Any, current: Any) -> bool:
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, int):
        return isinstance(value, int) and -_MAX_INT < value < _MAX_INT
    if isinstance(current, float):
        return _number(value) and math.isfinite(value)
    if isinstance(current, str):
        return isinstance(value, str)
    if isinstance(current, (list, tuple)):
        return isinstance(value, (list, tuple)) and len(value) == len(current) and all(
            _kind_matches(v, c) for v, c in zip(value, current))
    if isinstance(current, dict):
        return isinstance(value, dict)
    return True   # None or an object of the scheduler's own: its load_state_dict decides


def check_fields(saved: Any, live: dict, what: str, where: str, *,
                 required: bool = False) -> dict:
    """``saved`` must be a dict whose keys ``live`` (a ``state_dict()``) has, each value of
    the same kind as the live one (an int for an int, a finite number for a float, a list of
    as many for a list); with ``required`` it must also have every public key ``live``
    has (``load_state_dict`` reads them). Raises CheckpointError naming ``what[key]``."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: {what} is a {type(saved).__name__}, not an object")
    for key, value in saved.items():
        if key not in live:
            raise CheckpointError(f"{where}: {what} has the unknown key {key!r}")
        if not _kind_matches(value, live[key]):
            raise CheckpointError(f"{where}: {what}[{key!r}] is {value!r}; expected a value "
                                  f"like {live[key]!r}")
    if required:
        missing = [k for k in live if k not in saved and not str(k).startswith("_")]
        if missing:
            raise CheckpointError(f"{where}: {what} lacks {missing[0]!r}, which this "
                                  f"{what} needs to resume")
    return saved


def check_loss_scaler(saved: Any, live: dict, where: str) -> dict:
    """A loss scaler's state, by kind and by range: a positive finite scale no larger than
    2**64, a minimum within (0, scale], a factor above 1, a window and hysteresis of at
    least 1 and iteration counts that are counts."""
    state = check_fields(_plain(saved), live, "loss_scaler", where)
    merged = {**live, **state}

    def need(ok: bool, key: str, rule: str) -> None:
        if not ok:
            raise CheckpointError(f"{where}: loss_scaler[{key!r}] is {merged[key]!r}; {rule}")

    scale = merged["loss_scale"]
    need(0 < scale <= _MAX_SCALE, "loss_scale", f"it must lie in (0, {_MAX_SCALE:g}]")
    if merged["dynamic"]:
        need(0 < merged["min_scale"] <= scale, "min_scale",
             f"it must lie in (0, loss_scale={scale!r}] (a larger minimum skips every step)")
        need(1 < merged["scale_factor"] <= 65536, "scale_factor", "it must lie in (1, 65536]")
        need(merged["scale_window"] >= 1, "scale_window", "it must be at least 1")
        need(merged["hysteresis"] >= 1, "hysteresis", "it must be at least 1")
        need(0 <= merged["cur_hysteresis"] <= merged["hysteresis"], "cur_hysteresis",
             f"it must lie in [0, hysteresis={merged['hysteresis']!r}]")
        need(merged["cur_iter"] >= 0, "cur_iter", "it must not be negative")
        need(-1 <= merged["last_overflow_iter"] <= merged["cur_iter"], "last_overflow_iter",
             f"it must lie in [-1, cur_iter={merged['cur_iter']!r}]")
    return state


def check_data_loader(saved: Any, live: dict, where: str) -> dict:
    """A data loader's position: its fields by kind, every count non-negative (a negative
    ``batches_consumed`` would crash the loader at its next pass)."""
    state = check_fields(saved, live, "data_loader", where)
    for key, value in state.items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise CheckpointError(f"{where}: data_loader[{key!r}] is {value!r}; it must not "
                                  "be negative")
    for key in ("micro_batch_size", "world_size"):
        if key in state and state[key] == 0:
            raise CheckpointError(f"{where}: data_loader[{key!r}] is 0")
    return state


def check_scheduler(saved: Any, live: dict, where: str) -> dict:
    """A learning-rate scheduler's state: every public key the live one has (its
    ``load_state_dict`` reads them), each of the same kind."""
    return check_fields(_plain(saved), live, "lr_scheduler", where, required=True)


def check_counters(counters: dict, where: str) -> dict:
    """``global_steps``, ``global_samples``, ``skipped_steps``: counts below 2**62."""
    for key, value in counters.items():
        if not (isinstance(value, int) and not isinstance(value, bool)
                and 0 <= value < _MAX_INT):
            raise CheckpointError(f"{where}: {key} is {value!r}; expected a count in "
                                  f"[0, 2**62)")
    return counters


def _plain(value: Any) -> Any:
    """0-d tensors as Python numbers (DeepSpeed pickles some scalars as tensors)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def json_group_values(groups: list) -> list:
    """DeepSpeed's pickled parameter groups in the JSON form :func:`check_group_values`
    checks (tuples as lists, 0-d tensors as numbers), so both formats pass one check."""
    def plain(value: Any) -> Any:
        value = _plain(value)
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        return value
    return [{k: plain(v) for k, v in g.items()} if isinstance(g, dict) else g for g in groups]
