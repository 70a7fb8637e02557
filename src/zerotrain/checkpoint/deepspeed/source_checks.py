"""The structure checks of a DeepSpeed ZeRO checkpoint's files, before any element is read:
a field of the wrong type or size is named with its file (``source.py`` reads them)."""
from __future__ import annotations

from typing import Any

import torch

from ..manifest import CheckpointError


def malformed(path: str, exc: BaseException) -> CheckpointError:
    """A DeepSpeed file whose fields have the wrong type or size, named."""
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return CheckpointError(f"DeepSpeed checkpoint {path} is malformed (a field has the wrong "
                           f"type or size): {type(exc).__name__}: {text}")


def world_size(value: Any, files: int, where: str) -> int:
    if value is None:
        return files or 1
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
        raise CheckpointError(f"{where}: dp_world_size is {value!r}; expected a positive "
                              "integer")
    return value


def check_base_state(state: dict, where: str) -> None:
    """The base optimizer's saved state (moments, step, param_groups) has the shape
    DeepSpeed writes; a wrong type is named with its file and field."""
    field = "optimizer_state_dict" if "fp32_flat_groups" in state else "base_optimizer_state"
    saved = state.get(field)
    if saved is None:
        return
    if isinstance(saved, list) and field == "base_optimizer_state":   # elastic: per group
        entries = {f"{field}[{i}]": entry for i, entry in enumerate(saved)}
    elif isinstance(saved, dict):
        per = saved.get("state", {})
        if not isinstance(per, dict):
            raise CheckpointError(f"{where}: {field}['state'] is a {type(per).__name__}; "
                                  "expected a dict of per-partition optimizer states")
        entries = {f"{field}['state'][{k!r}]": entry for k, entry in per.items()}
        groups = saved.get("param_groups", [])
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict)
                                                             for g in groups):
            raise CheckpointError(f"{where}: {field}['param_groups'] is not a list of dicts")
    else:
        raise CheckpointError(f"{where}: {field} is a {type(saved).__name__}; expected a dict "
                              "(an optimizer's state_dict)")
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: {name} is a {type(entry).__name__}; expected a "
                                  "dict of the partition's optimizer state")


def check_flat_sizes(states: list[dict], files: tuple[str, ...]) -> None:
    """Every rank's flat partition of a group is the same size (after its padding): a
    partition of the wrong length is named with its file before any element is read."""
    expected: list[int] = []
    for rank, state in enumerate(states):
        key = "fp32_flat_groups" if "fp32_flat_groups" in state else \
            "single_partition_of_fp32_groups"
        flats = state[key]
        lean = key == "single_partition_of_fp32_groups" and "zero_stage" in state
        paddings = state.get("group_paddings") if lean else None
        if paddings is None:
            paddings = [0] * len(flats)
        if not isinstance(paddings, (list, tuple)) or len(paddings) != len(flats) or not all(
                isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in paddings):
            raise CheckpointError(f"{files[rank]}: group_paddings is {paddings!r}; expected "
                                  f"{len(flats)} non-negative integers, one per partition")
        sizes = [t.numel() + p for t, p in zip(flats, paddings)]
        if rank == 0:
            expected = sizes
            continue
        if len(sizes) != len(expected):
            raise CheckpointError(f"{files[rank]}: {key} has {len(sizes)} partitions; rank 0's "
                                  f"file {files[0]} has {len(expected)}")
        for g, (size, want) in enumerate(zip(sizes, expected)):
            if size != want:
                raise CheckpointError(
                    f"{files[rank]}: {key}[{g}] holds {flats[g].numel()} elements (padding "
                    f"{paddings[g]}) where rank 0's file {files[0]} holds {want}; every rank's "
                    "partition of a group is the same size")


def check_flats(state: dict, where: str) -> None:
    key = "fp32_flat_groups" if "fp32_flat_groups" in state else \
        "single_partition_of_fp32_groups"
    flats = state[key]
    if not isinstance(flats, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) and t.dim() == 1 for t in flats):
        raise CheckpointError(f"{where}: {key} is not a list of 1-D tensors")
