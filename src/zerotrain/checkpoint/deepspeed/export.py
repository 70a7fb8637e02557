"""Full fp32 weights out of a DeepSpeed ZeRO checkpoint, one tensor at a time.

Each trainable parameter is assembled from its pieces in the rank files' fp32 partitions
(memory-mapped, Note: DeepSpeed's partitions in ``layout.py``), so memory holds one
parameter at a time plus the pages the copy touches. Frozen parameters and floating buffers
come out in fp32 from the model-states file, integer buffers as they are, and tied
parameters (``shared_params``) under each of their names. Without optimizer-state files
the module weights of the model-states file (stages 1-2) are exported, cast to fp32.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import torch

from ... import untrusted
from ..manifest import CheckpointError
from ..stfile import TensorSpec
from .source import DeepSpeedCheckpoint


class DeepSpeedExport:
    """What ``consolidate`` needs from a DeepSpeed tag: specs, one tensor at a time, and
    the model's ``config.json`` when the save directory has one (the Hugging Face Trainer
    writes it beside ``latest``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ckpt = DeepSpeedCheckpoint(path)
        self._dtypes = self._module_dtypes()

    def specs(self) -> list[TensorSpec]:
        ckpt = self.ckpt
        aliases = ckpt.shared_params()
        names = ckpt.state_dict_order() + list(aliases)
        out = []
        for name in dict.fromkeys(names):
            source = aliases.get(name, name)
            dtype = self._dtypes.get(source, torch.float32)
            out.append(TensorSpec(name, torch.float32 if dtype.is_floating_point else dtype,
                                  ckpt.full_shape(source)))
        return out

    def read(self, spec: TensorSpec) -> torch.Tensor:
        name = self.ckpt.shared_params().get(spec.key, spec.key)
        if name in self.ckpt.params:
            out = torch.empty(self.ckpt.params[name].numel, dtype=torch.float32)
            self.ckpt.read_into(name, "master", 0, out.numel(), out)
            return out.view(spec.shape)
        return self.ckpt.module_tensor(name).to(spec.dtype).reshape(spec.shape).contiguous()

    def hf_config(self) -> Optional[dict]:
        folder = os.path.dirname(os.path.abspath(self.path))
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            return None
        try:
            value = untrusted.read_json(path, what="model config", root=folder,
                                        max_bytes=untrusted.CONFIG_MAX_BYTES)
        except (FileNotFoundError, untrusted.UnsafeFile) as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        return value if isinstance(value, dict) else None

    def _module_dtypes(self) -> dict[str, torch.dtype]:
        module = self.ckpt.model.get("module") or {}
        return {n: v.dtype for n, v in module.items() if isinstance(v, torch.Tensor)}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in self.specs():
            yield spec.key, self.read(spec)
