"""DeepSpeed's ``torch_autocast``: fp32 parameters, the engine's forward under
``torch.autocast``.

Note: what is honoured
    DeepSpeed 0.19.8 (``runtime/torch_autocast.py``) keeps the parameters in their dtype
    (fp32, or bf16 beside ``bf16.enabled``) and runs the engine's forward under
    ``torch.autocast(dtype)``
    (replacing an autocast the caller opened; DeepSpeed also turns off one the caller
    opened when the section is off, which zerotrain does not). It also tags the parameters of ``lower_precision_safe_modules``
    (torch's Linear and Conv1d/2d/3d unless listed) with the autocast dtype: their
    gradients are reduced in that dtype, and at stage 3 they are gathered in it; all other
    gradients are reduced in their own dtype (``communication_data_type`` is not read).
    zerotrain reduces every gradient of a stage in one dtype, so it honours the section
    where that is what DeepSpeed does: bf16 parameters under a bf16 autocast (every
    gradient in bf16), or fp32 parameters with no trained parameter tagged (the list
    names no module class of the model, e.g. ``[]``: every gradient in fp32); a model
    with fp32 parameters tagged is refused by name at ``initialize``; ``dtype`` fp16
    (DeepSpeed's GradScaler path) and ``fp16.enabled`` are refused in
    ``config/precision_checks.py``.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from ..config import ZeroTrainConfig
from ..config.sections import AUTOCAST_DTYPES
from ..core.precision import DTYPES
from ..errors import ConfigError

# DeepSpeed's LOWER_PRECISION_SAFE_MODULES
DEFAULT_SAFE_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_KEY = "torch_autocast.lower_precision_safe_modules"


def safe_module_classes(names: Optional[Sequence[str]]) -> tuple[type, ...]:
    """The classes ``lower_precision_safe_modules`` names (dotted paths), DeepSpeed's
    defaults when unset; ConfigError naming the entry that does not import."""
    if names is None:
        return DEFAULT_SAFE_MODULES
    classes = []
    for name in names:
        package, _, attr = name.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(package), attr))
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(_KEY, f"cannot import {name!r}: {exc}", value=name) from None
    return tuple(classes)


def autocast_dtype(config: ZeroTrainConfig, device: torch.device) -> Optional[torch.dtype]:
    """The dtype of the engine's autocast, None when ``torch_autocast`` is off. Unset:
    torch's default for the device (bf16 on the CPU), refused when that is fp16."""
    section = config.torch_autocast
    if not section.enabled:
        return None
    if section.dtype is not None:
        return DTYPES[AUTOCAST_DTYPES[section.dtype]]
    dtype = torch.get_autocast_dtype(device.type)
    if dtype == torch.float16:
        raise ConfigError("torch_autocast.dtype", f"unset, which is torch's default for "
                          f"{device.type}, float16: fp16 autocast is not implemented; set "
                          '"bfloat16"', value=None)
    return dtype


def check_reduction(config: ZeroTrainConfig, model: nn.Module) -> None:
    """Refuse a model whose trained parameters DeepSpeed would reduce in the autocast dtype
    while others are reduced in their own (Note: what is honoured), naming them. With bf16
    parameters and a bf16 autocast the two are one dtype: every gradient is reduced in
    bf16, as zerotrain reduces bf16 gradients."""
    if not config.torch_autocast.enabled:
        return
    dtype = autocast_dtype(config, torch.device("cpu"))
    if config.precision == "bf16" and (config.torch_autocast.dtype is None
                                       or dtype == torch.bfloat16):
        return
    classes = safe_module_classes(config.torch_autocast.lower_precision_safe_modules)
    tagged = [f"{prefix}.{name}" if prefix else name
              for prefix, module in model.named_modules() if type(module) in classes
              for name, p in module.named_parameters(recurse=False) if p.requires_grad]
    if tagged:
        shown = ", ".join(repr(n) for n in tagged[:4]) + (" ..." if len(tagged) > 4 else "")
        raise ConfigError(_KEY, f"DeepSpeed reduces the gradients of these modules' parameters "
                          f"in the autocast dtype ({shown}: {len(tagged)} parameters) and the "
                          "others in fp32; zerotrain reduces a stage's gradients in one dtype "
                          "and does not implement the split. Set it to [] (every gradient "
                          "reduced in fp32)", value=config.torch_autocast.
                          lower_precision_safe_modules)


@contextlib.contextmanager
def forward_context(dtype: Optional[torch.dtype], device: torch.device) -> Iterator[None]:
    """Around the engine's forward, as DeepSpeed's ``autocast_if_enabled`` when the section
    is on: autocast in ``dtype``, replacing the caller's. Off, the caller's autocast is
    left as it is (DeepSpeed turns it off; zerotrain always kept it)."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype, enabled=True):
        yield
