"""What the two DeepSpeed writers share (stages 1-2 in ``write.py``, stage 3 in
``write3.py``): the model-states dict, each optimizer group's members and state, and
``save_file`` with the pickler that writes DeepSpeed's loss scaler by class name. Kept apart
so neither writer imports the other back, and ``file_names.py`` builds its stand-in files
without importing ``consolidate``.
"""
from __future__ import annotations

import pickle
import types
from collections import OrderedDict
from typing import Any, Optional

import torch

from ...core.records import FROZEN
from ..manifest import CheckpointError
from ..reshard import SourceIndex

DS_VERSION = "0.19.8"


def group_members(manifest: dict) -> list[list[str]]:
    """Each optimizer group's parameter names in the module's order: the order DeepSpeed
    flattens a group in (``param_shapes``)."""
    order = {n: i for i, n in enumerate(manifest.get("state_dict_order", []))}
    groups: dict[int, list[str]] = {}
    for record in manifest["records"]:
        if record["group_index"] != FROZEN:
            groups.setdefault(record["group_index"], []).extend(record["names"])
    return [sorted(groups.get(g, []), key=lambda n: order.get(n, len(order)))
            for g in range(len(manifest["optimizer"]["param_groups"]))]


def group_state(index: SourceIndex, names: list[str]) -> tuple[list[str], Optional[float]]:
    """The optimizer state keys and the Adam step of one group's parameters, which DeepSpeed
    keeps once per group (raises naming the parameter or the steps that differ)."""
    records = [index.params[n].record for n in names]
    keys = list(records[0]["state_tensors"]) if records else []
    for name, record in zip(names, records):
        if list(record["state_tensors"]) != keys:
            raise CheckpointError(f"parameter {name!r} has optimizer state "
                                  f"{record['state_tensors']}, others of its group {keys}")
    steps = {float(r["state_scalars"]["step"]["value"]) for r in records
             if "step" in r["state_scalars"]}
    if len(steps) > 1:
        raise CheckpointError(f"the parameters of one optimizer group have different Adam "
                              f"steps {sorted(steps)}; DeepSpeed keeps one per group")
    return keys, (steps.pop() if steps else None)


def model_states(manifest: dict, module: dict, members: list[list[str]], world: int) -> dict:
    """DeepSpeed's model-states dict: ``module`` as given, shapes from the manifest."""
    in_groups = {n for names in members for n in names}
    shapes = {n: s for r in manifest["records"] for n, s in zip(r["names"], r["shapes"])}
    buffers = [e["name"] for e in manifest["buffers"]]
    frozen = [e for e in manifest["frozen"]]
    counters = manifest["counters"]
    states = {
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(shapes[n])) for n in names)
                         for names in members],
        "frozen_param_shapes": OrderedDict((e["name"], torch.Size(e["shape"])) for e in frozen
                                           if e["name"] not in in_groups
                                           and e["name"] in module),
        "shared_params": {},
        # DeepSpeed's stage 2 saves each frozen parameter whole here; its zero_to_fp32 reads
        # them from it (an entry of frozen_param_shapes without one is a KeyError there)
        "frozen_param_fragments": OrderedDict((e["name"], module[e["name"]]) for e in frozen
                                              if e["name"] not in in_groups
                                              and e["name"] in module),
        "lr_scheduler": manifest.get("lr_scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(counters["skipped_steps"]),
        "global_steps": int(counters["global_steps"]),
        "global_samples": int(counters["global_samples"]),
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_version": DS_VERSION,
    }
    client = manifest.get("client_state") or {}
    if isinstance(client, dict) and not manifest.get("client_state_file"):
        states.update({k: v for k, v in client.items() if k not in states})
    return states


# ------------------------------------------------------------------ DeepSpeed's loss scaler
class DeepSpeedObject:
    """An object of a DeepSpeed class: its dotted class name and its ``__dict__``."""

    def __init__(self, qualname: str, state: dict) -> None:
        self.qualname, self.state = qualname, state

    def __reduce__(self) -> tuple:
        raise TypeError(f"{self.qualname} is written by DeepSpeedPickler only")


class DeepSpeedPickler(pickle._Pickler):   # the Python pickler: ``save`` can be extended
    """Writes a :class:`DeepSpeedObject` as protocol 2 writes an instance (GLOBAL naming
    the class, NEWOBJ, BUILD with its ``__dict__``): where DeepSpeed is installed it reads
    back as DeepSpeed's own object."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if not isinstance(obj, DeepSpeedObject):
            return super().save(obj, save_persistent_id)
        module, _, name = obj.qualname.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{name}\n".encode("ascii"))
        self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
        super().save(obj.state)
        self.write(pickle.BUILD)


PICKLE_MODULE = types.SimpleNamespace(Pickler=DeepSpeedPickler, __name__="pickle")



def save_file(value: dict, path: str, *, pickler: bool = False) -> str:
    """``torch.save`` with a named error; ``pickler``: through :data:`PICKLE_MODULE`, which
    writes DeepSpeed's loss scaler by class name."""
    try:
        if pickler:
            torch.save(value, path, pickle_module=PICKLE_MODULE)
        else:
            torch.save(value, path)
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path
