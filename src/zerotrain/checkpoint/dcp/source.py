"""A torch DCP checkpoint (FSDP2's ``get_state_dict`` saved with ``dcp.save``) as the
DeepSpeed importer reads a source: parameters by name, element ranges of weights and Adam
moments, hyperparameters and the step count.

Which keys are what: the model's tensors are ``model.<name>`` (or ``<name>`` at the top,
torchtitan's layout); the optimizer's are ``optim|optimizer.state.<name>.<key>`` and its
groups ``optim|optimizer.param_groups.<i>.<key>``, as ``get_state_dict`` returns them. The
tensor payloads are ``torch.save`` records read through the one opener
(``untrusted.open_file``: regular files inside the folder) and the one bounded unpickler
(``restricted.load_torch``); ``.metadata`` goes through ``metadata.py``.

Note: a chunk's declared sizes are bounded before anything is read or allocated
    ``.metadata`` declares each entry's shape and each chunk's byte range; nothing makes
    them true. Before a tensor is allocated every chunk must declare a byte length that
    its elements need (at most :data:`RECORD_SLACK` more for the record's zip headers), lie
    inside its file's real size, and not share bytes with another chunk of the entry; and
    the chunks must cover the shape. So what an entry allocates is bounded by the bytes
    really on disk, and what a chunk reads by its shape and dtype.
"""
from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Any, Optional

import torch

from ... import untrusted
from ..manifest import CheckpointError, check_regular_file, save_identity
from ..restricted import load_torch
from .metadata import METADATA_NAME, Entry, read_metadata

_OPTIM_KEYS = ("optim", "optimizer")
RECORD_SLACK = 1 << 20           # a torch.save record's zip headers around a tensor's bytes
MAX_BYTES_ITEM = 64 << 20        # a pickled non-tensor item (param_groups, a step count)
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
        self._sizes: dict[str, int] = {}

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
        self._check_chunks(entry)
        out = torch.zeros(entry.shape, dtype=entry.dtype)
        covered = 0
        itemsize = out.element_size()
        for chunk in entry.chunks:
            value = self._load(chunk, entry.key, math.prod(chunk.sizes) * itemsize
                               + RECORD_SLACK)
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

    def _file_size(self, name: str) -> int:
        """The real size of chunk file ``name``, checked by the one opener (a regular file
        whose real path lies inside the checkpoint folder)."""
        if name not in self._sizes:
            self._sizes[name] = check_regular_file(os.path.join(self.path, name),
                                                   what="torch DCP chunk file", root=self.path)
        return self._sizes[name]

    def _check_chunks(self, entry: Entry) -> None:
        """Note: a chunk's declared sizes are bounded before anything is read or allocated."""
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        spans: dict[str, list[tuple[int, int]]] = {}
        covered = 0
        for chunk in entry.chunks:
            where = f"{self.path}: the chunk of {entry.key!r} at {chunk.offsets} in {chunk.file}"
            need = math.prod(chunk.sizes) * itemsize
            if not need <= chunk.length <= need + RECORD_SLACK:
                raise CheckpointError(f"{where} declares {chunk.length} bytes for "
                                      f"{math.prod(chunk.sizes)} {entry.dtype} elements "
                                      f"({need} bytes of data); refusing to read it")
            size = self._file_size(chunk.file)
            if chunk.offset + chunk.length > size:
                raise CheckpointError(f"{os.path.join(self.path, chunk.file)} ends before "
                                      f"{entry.key!r} (bytes {chunk.offset}.."
                                      f"{chunk.offset + chunk.length}; the file is {size} "
                                      "bytes)")
            spans.setdefault(chunk.file, []).append((chunk.offset, chunk.offset + chunk.length))
            covered += math.prod(chunk.sizes)
        for file, ranges in spans.items():
            ranges.sort()
            if any(end > start for (_, end), (start, _) in zip(ranges, ranges[1:])):
                raise CheckpointError(f"{self.path}: two chunks of {entry.key!r} share bytes "
                                      f"of {file}; refusing to read them")
        numel = math.prod(entry.shape)
        if covered < numel:
            raise CheckpointError(f"{self.path}: the chunks of {entry.key!r} cover {covered} "
                                  f"of its {numel} elements (shape {entry.shape}); refusing "
                                  "to allocate it")

    def _load(self, chunk, key: str, bound: int) -> Any:
        """One chunk's record: at most ``bound`` bytes (what its entry may declare), inside
        the file's real size, through the one opener and the bounded unpickler."""
        path = os.path.join(self.path, chunk.file)
        what = "torch DCP chunk file"
        if chunk.length > bound:
            raise CheckpointError(f"{path}: {key!r} declares {chunk.length} bytes, more than "
                                  f"the {bound} it may hold; refusing to read it")
        try:
            with untrusted.open_file(path, what=what, root=self.path) as f:
                if chunk.offset + chunk.length > f.size:
                    raise CheckpointError(f"{path} ends before {key!r} (bytes {chunk.offset}.."
                                          f"{chunk.offset + chunk.length}; the file is "
                                          f"{f.size} bytes)")
                data = f.read(chunk.offset, chunk.length)
        except FileNotFoundError:
            raise CheckpointError(f"{what} {path} is missing") from None
        except untrusted.UnsafeFile as exc:
            raise CheckpointError(f"{exc} (reading {key!r})") from None
        try:
            return load_torch(data, path=path, what=what)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch's restricted unpickler refused it
            raise CheckpointError(f"cannot read {key!r} from {path}: {type(exc).__name__}: "
                                  f"{exc}") from None

    def _bytes(self, entry: Entry) -> Any:
        if not entry.chunks:
            raise CheckpointError(f"{self.path}: {entry.key!r} has no storage entry")
        return self._load(entry.chunks[0], entry.key, MAX_BYTES_ITEM)

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
