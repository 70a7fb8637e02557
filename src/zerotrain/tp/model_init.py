"""``deepspeed.tp_model_init``: the record-only call transformers' Trainer makes before
``initialize`` when its DeepSpeed config sets ``tensor_parallel.autotp_size``.

As in DeepSpeed 0.19 the model is not cut here: ``initialize`` cuts it, and the config stays
the canonical source. What the call records is checked against the config there, so a
``tp_size`` or ``dtype`` that disagrees with it is an error naming both, never a silent
choice of one.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from ..errors import ConfigError

_RECORD = "_zerotrain_tp_model_init"


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype,
                  config: Optional[Union[str, Mapping[str, Any]]] = None,
                  **kwargs: Any) -> nn.Module:
    """Record ``tp_size`` and ``dtype`` on ``model`` for ``initialize`` and return it uncut."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tp_model_init takes an nn.Module, got {type(model).__name__}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError("tensor_parallel.autotp_size",
                          f"tp_model_init(tp_size={tp_size!r}): a positive int is needed",
                          value=tp_size)
    if kwargs.get("tp_group") is not None:
        raise ConfigError("tp_group", "tp_model_init(tp_group=...): zerotrain builds the "
                          "tensor-parallel groups from tensor_parallel.autotp_size itself; "
                          "leave tp_group out")
    setattr(model, _RECORD, (tp_size, dtype))
    return model


def check_recorded(model: nn.Module, autotp_size: int, param_dtype: torch.dtype) -> None:
    """At ``initialize``: what ``tp_model_init`` recorded must agree with the config."""
    recorded = getattr(model, _RECORD, None)
    if recorded is None:
        return
    tp_size, dtype = recorded
    if tp_size > 1 and autotp_size <= 1:
        raise ConfigError("tensor_parallel.autotp_size",
                          f"tp_model_init(tp_size={tp_size}) was called but the config sets no "
                          f"tensor_parallel.autotp_size; add \"tensor_parallel\": "
                          f"{{\"autotp_size\": {tp_size}}}")
    if tp_size != max(1, autotp_size):
        raise ConfigError("tensor_parallel.autotp_size",
                          f"{autotp_size} in the config but tp_model_init(tp_size={tp_size}); "
                          "make them equal", value=autotp_size)
    if dtype is not None and dtype != param_dtype:
        raise ConfigError("tensor_parallel",
                          f"tp_model_init(dtype={dtype}) but the config trains in "
                          f"{param_dtype} (fp16/bf16 sections); make them agree")
