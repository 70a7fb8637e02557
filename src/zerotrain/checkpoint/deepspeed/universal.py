"""DeepSpeed Universal Checkpoint folders (``ds_to_universal`` output), read as a source.

Note: the Universal layout
    ``ds_to_universal --input_folder ckpt/global_stepN --output_folder
    ckpt/global_stepN_universal`` writes, per trainable parameter, ``zero/<name>/fp32.pt``,
    ``exp_avg.pt``, ``exp_avg_sq.pt`` (each ``{"param": full tensor, ...}``) and ``step.pt``
    (a tensor), the optimizer's unsharded state in ``zero/optimizer_state.pt`` (its
    ``param_groups``, loss scaler, ``zero_stage``), and copies the model-states files beside
    ``zero/``. DeepSpeed loads it with ``"checkpoint": {"load_universal": true}`` and the
    folder's name as tag; zerotrain recognises it by ``zero/optimizer_state.pt`` and reads
    every file through the restricted unpickler, so any world size and stage can take it.
"""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any, Optional

import torch

from ... import untrusted
from ..fs import read_latest_text
from ..manifest import CheckpointError
from .files import is_deepspeed_tag_dir
from .source import DeepSpeedCheckpoint
from .unpickle import load_file

ZERO_DIR = "zero"
OPTIMIZER_FILE = "optimizer_state.pt"
LATEST_UNIVERSAL = "latest_universal"


def is_universal_dir(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, ZERO_DIR, OPTIMIZER_FILE))
            and is_deepspeed_tag_dir(path))


def find_universal_dir(load_dir: str, tag: Optional[Any] = None) -> Optional[str]:
    """The Universal folder ``load_dir/tag``, ``load_dir`` itself, or the one
    ``latest_universal`` (then ``latest``) names; None when there is none."""
    if tag is not None:
        path = os.path.join(load_dir, str(tag))
        return path if "/" not in str(tag) and is_universal_dir(path) else None
    if is_universal_dir(load_dir):
        return load_dir
    for pointer in (LATEST_UNIVERSAL, "latest"):
        try:
            named = _read_pointer(load_dir, pointer)
        except CheckpointError:
            return None
        if named and "/" not in named and named not in (".", ".."):
            path = os.path.join(load_dir, named)
            if is_universal_dir(path):
                return path
    return None


def _read_pointer(load_dir: str, name: str) -> Optional[str]:
    if name == "latest":
        return read_latest_text(load_dir)
    try:
        return untrusted.read_text(os.path.join(load_dir, name), what="pointer file",
                                   root=load_dir, max_bytes=4096).strip()
    except (FileNotFoundError, untrusted.UnsafeFile):
        return None


class UniversalCheckpoint(DeepSpeedCheckpoint):
    """A Universal folder with :class:`DeepSpeedCheckpoint`'s reading methods: the small
    state from the copied model-states file, parameters from ``zero/<name>/``."""

    what = "DeepSpeed Universal"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        zero = os.path.join(path, ZERO_DIR)
        self._zero = zero
        state = load_file(os.path.join(zero, OPTIMIZER_FILE), mmap=False, root=path)
        if not isinstance(state, dict):
            raise CheckpointError(f"{os.path.join(zero, OPTIMIZER_FILE)} holds a "
                                  f"{type(state).__name__}, not a dict")
        self.optim = [state]
        self.optim_files = (os.path.join(zero, OPTIMIZER_FILE),)
        self.params = {}
        for group, shapes in enumerate(self.model.get("param_shapes") or []):
            for name in shapes:
                folder = os.path.join(zero, name)
                if not os.path.lexists(os.path.join(folder, "fp32.pt")):
                    raise CheckpointError(f"Universal checkpoint {path} has no "
                                          f"{os.path.join(ZERO_DIR, name, 'fp32.pt')}")
                self.params[name] = SimpleNamespace(group=group)
        self._cache: Optional[tuple[tuple[str, str], torch.Tensor]] = None

    @property
    def stage(self) -> int:
        record = self.optim[0].get("zero_stage")
        args = getattr(record, "args", None)
        return int(args[0]) if args else 0

    def _tensor(self, name: str, key: str) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == (name, key):
            return self._cache[1]
        file = os.path.join(self._zero, name, f"{'fp32' if key == 'master' else key}.pt")
        if not os.path.lexists(file):
            raise CheckpointError(f"Universal checkpoint {self.path} has no {file}")
        value = load_file(file, mmap=False, root=self.path)
        if isinstance(value, dict):
            value = value.get("param")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{file} holds no tensor 'param'")
        shape = self.full_shape(name)
        if key != "step" and value.numel() != torch.Size(shape).numel():
            raise CheckpointError(f"{file} has {value.numel()} elements; {name!r} has shape "
                                  f"{tuple(shape)}")
        value = value.detach()
        self._cache = ((name, key), value)
        return value

    def read_into(self, name: str, key: str, start: int, end: int, out: torch.Tensor) -> None:
        if name not in self.params:
            super().read_into(name, key, start, end, out)
            return
        with torch.no_grad():
            out.copy_(self._tensor(name, key).reshape(-1)[start:end])

    def state_keys(self, name: str) -> tuple[list[str], Optional[float]]:
        folder = os.path.join(self._zero, name)
        keys = sorted(n[:-3] for n in os.listdir(folder)
                      if n.endswith(".pt") and n not in ("fp32.pt", "step.pt"))
        step = None
        if os.path.isfile(os.path.join(folder, "step.pt")):
            step = float(self._tensor(name, "step"))
        else:
            groups = self.param_groups()
            group = self.params[name].group
            if group < len(groups) and groups[group].get("step") is not None:
                step = float(groups[group]["step"])
        return keys, step

    def param_groups(self) -> list[dict]:
        return list(self.optim[0].get("param_groups") or [])
