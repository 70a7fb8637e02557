"""A torch DCP checkpoint (FSDP2's ``get_state_dict`` saved with ``dcp.save``) as the
DeepSpeed importer reads a source: parameters by name, element ranges of weights and Adam
moments, hyperparameters and the step count.

Which keys are what: the model's tensors are ``model.<name>`` (or ``<name>`` at the top,
torchtitan's layout); the optimizer's are ``optim|optimizer.state.<name>.<key>`` and its
groups ``optim|optimizer.param_groups.<i>.<key>``, as ``get_state_dict`` returns them. The
tensor payloads are ``torch.save`` records read with ``torch.load(weights_only=True)``
(torch's own restricted unpickler); ``.metadata`` goes through ``metadata.py``.
"""
from __future__ import annotations

import io
import math
import os
from types import SimpleNamespace
from typing import Any, Optional

import torch

from ..manifest import CheckpointError, save_identity
from .metadata import METADATA_NAME, Entry, read_metadata

_OPTIM_KEYS = ("optim", "optimizer")
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening",
                    "nesterov")


def is_dcp_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_NAME))


class DcpCheckpoint:
    """One DCP directory, indexed against ``module`` (which names are parameters, buffers or
    tied aliases). No process group needed."""

    stage = 0
    what = "torch DCP"

    def __init__(self, path: str, module: torch.nn.Module) -> None:
        self.path = path
        entries = read_metadata(path)
        self.model: dict[str, Entry] = {}
        self.states: dict[str, dict[str, Entry]] = {}
        group_keys: dict[int, dict[str, Entry]] = {}
        for entry in entries.values():
            route = entry.path
            if len(route) == 4 and route[0] in _OPTIM_KEYS and route[1] == "state":
                self.states.setdefault(str(route[2]), {})[str(route[3])] = entry
            elif len(route) == 4 and route[0] in _OPTIM_KEYS and route[1] == "param_groups":
                group_keys.setdefault(int(route[2]), {})[str(route[3])] = entry
            elif len(route) == 2 and route[0] == "model":
                self.model[str(route[1])] = entry
            elif len(route) == 1 and entry.shape is not None:
                self.model[str(route[0])] = entry
        if not self.model:
            raise CheckpointError(f"torch DCP checkpoint {path} holds no model tensors (keys "
                                  "'model.<name>' or top-level parameter names)")
        self.groups = [{k: self._bytes(e) for k, e in group_keys[i].items()}
                       for i in sorted(group_keys)]
        self.has_optimizer = bool(self.states)
        self.optim_files = sorted({c.file for e in entries.values() for c in e.chunks})
        self.world = len(self.optim_files)
        group_of = {name: i for i, g in enumerate(self.groups) for name in g.get("params", [])}
        module_params = dict(module.named_parameters())
        persistent = set(module.state_dict(keep_vars=True).keys())
        self._buffers = [n for n, _ in module.named_buffers() if n in persistent
                         and n in self.model]
        trainable = [n for n in self.model if n in module_params
                     and (n in self.states or not self.has_optimizer)]
        self.params = {n: SimpleNamespace(group=group_of.get(n, 0)) for n in trainable}
        self._aliases = {n: n for n in self.model if n in persistent and n not in module_params
                         and n not in self._buffers}
        self._frozen = [n for n in self.model if n not in self.params
                        and n not in self._buffers and n not in self._aliases]
        self._cache: Optional[tuple[tuple[str, str], torch.Tensor]] = None

    @property
    def model_file(self) -> str:
        """The file that errors about the small state name (DCP keeps it in ``.metadata``)."""
        return os.path.join(self.path, METADATA_NAME)

    def identity(self) -> int:
        """A hash of this save (every file's size): ranks that read two saves of one folder
        (written again meanwhile) differ here, and the load's agreement refuses."""
        files = [os.path.join(self.path, name) for name in self.optim_files]
        sizes = [os.path.getsize(f) if os.path.isfile(f) else -1 for f in files]
        return save_identity(repr((os.path.getsize(self.model_file), sizes)))

    # ------------------------------------------------------------------ tensors
    def _entry(self, name: str, key: str) -> Entry:
        entry = self.model.get(name) if key == "master" else self.states.get(name, {}).get(key)
        if entry is None or entry.shape is None:
            raise CheckpointError(f"torch DCP checkpoint {self.path} has no tensor {key!r} for "
                                  f"{name!r}")
        return entry

    def full(self, name: str, key: str) -> torch.Tensor:
        """The whole tensor ``key`` ("master": the weight) of ``name``, from its chunks."""
        if self._cache is not None and self._cache[0] == (name, key):
            return self._cache[1]
        entry = self._entry(name, key)
        out = torch.zeros(entry.shape, dtype=entry.dtype)
        covered = 0
        for chunk in entry.chunks:
            value = self._load(chunk, entry.key)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != chunk.sizes:
                raise CheckpointError(f"{self.path}: the chunk of {entry.key!r} at "
                                      f"{chunk.offsets} in {chunk.file} is not a tensor of "
                                      f"shape {chunk.sizes}")
            view = out
            for dim, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes)):
                view = view.narrow(dim, o, s)
            view.copy_(value)
            covered += math.prod(chunk.sizes)
        if covered < out.numel():
            raise CheckpointError(f"{self.path}: the chunks of {entry.key!r} cover {covered} "
                                  f"of its {out.numel()} elements")
        self._cache = ((name, key), out)
        return out

    def _load(self, chunk, key: str) -> Any:
        path = os.path.join(self.path, chunk.file)
        try:
            with open(path, "rb") as f:
                f.seek(chunk.offset)
                data = f.read(chunk.length)
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
        if len(data) != chunk.length:
            raise CheckpointError(f"{path} ends before {key!r} (bytes {chunk.offset}.."
                                  f"{chunk.offset + chunk.length})")
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch's restricted unpickler refused it
            raise CheckpointError(f"cannot read {key!r} from {path}: {type(exc).__name__}: "
                                  f"{exc}") from None

    def _bytes(self, entry: Entry) -> Any:
        if not entry.chunks:
            raise CheckpointError(f"{self.path}: {entry.key!r} has no storage entry")
        return self._load(entry.chunks[0], entry.key)

    def read_into(self, name: str, key: str, start: int, end: int, out: torch.Tensor) -> None:
        out.copy_(self.full(name, key).reshape(-1)[start:end])

    def state_keys(self, name: str) -> tuple[list[str], Optional[float]]:
        shape = self.full_shape(name)
        saved = self.states.get(name, {})
        keys = sorted(k for k, e in saved.items() if e.shape == shape)
        step = None
        if "step" in saved:
            value = self.full(name, "step") if saved["step"].shape is not None \
                else self._bytes(saved["step"])
            step = float(value)
        return keys, step

    def module_tensor(self, name: str) -> torch.Tensor:
        return self.full(name, "master").clone()

    def full_shape(self, name: str) -> tuple[int, ...]:
        entry = self.model.get(name)
        if entry is None or entry.shape is None:
            raise CheckpointError(f"{name!r} is not in torch DCP checkpoint {self.path}")
        return entry.shape

    # ------------------------------------------------------------------ names
    def trainable_names(self) -> list[str]:
        return list(self.params)

    def buffer_names(self) -> list[str]:
        return list(self._buffers)

    def frozen_names(self) -> list[str]:
        return list(self._frozen)

    def shared_params(self) -> dict[str, str]:
        return dict(self._aliases)

    # ------------------------------------------------------------------ small state
    def counters(self) -> dict[str, int]:
        steps = {self.state_keys(n)[1] for n in self.params if "step" in self.states.get(n, {})}
        steps.discard(None)
        return {"global_steps": int(max(steps))} if steps else {}

    def client_state(self) -> dict:
        return {}

    def lr_scheduler_state(self) -> Optional[dict]:
        return None

    def param_groups(self) -> list[dict]:
        return list(self.groups)

    def hyperparameters(self) -> list[dict]:
        return [{k: g[k] for k in _HYPERPARAMETERS if k in g} for g in self.groups]

    def loss_scaler_state(self) -> Optional[dict]:
        return None
