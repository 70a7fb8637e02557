"""The engine and its parts: :class:`ZeroEngine` orchestrates forward, backward and step
over a stage (``engine``), with DeepSpeed's accessors (``api``), its reports (``reports``),
saving and loading (``persistence``), which backwards reduce (``accumulation``), which
engine holds a model (``ownership``), ``torch.compile`` (``compile``), the step timers
(``timers``, ``throughput``), the scheduler watch (``lr_watch``) and the autograd gate on its
outputs (``direct_backward``). What ``initialize`` uses to build one: the ranks' fingerprint
(``fingerprint``), the optimizer and scheduler (``optimizer_choice``) and auto-resume
(``resume``).

``from zerotrain.engine import ZeroEngine`` keeps working; the class is loaded on first use,
so importing a part (``zerotrain.engine.timers``) does not load the whole engine.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ZeroEngine"]


def __getattr__(name: str) -> Any:
    if name == "ZeroEngine":
        from .engine import ZeroEngine
        return ZeroEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
