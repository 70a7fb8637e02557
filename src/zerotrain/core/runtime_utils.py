"""DeepSpeed's ``deepspeed.runtime.utils`` names zerotrain provides: ``see_memory_usage``
(``memory.py``) and ``move_to_device``."""
from __future__ import annotations

from typing import Any, Callable, Optional

from .memory import see_memory_usage

__all__ = ["move_to_device", "see_memory_usage"]


def move_to_device(item: Any, device, criterion_func: Optional[Callable[[Any], bool]] = None):
    """``item`` (a tensor, or lists, tuples and dicts of them, nested) on ``device``, as
    DeepSpeed's: an item ``criterion_func`` accepts is moved in place (its ``.data``
    replaced) and returned; containers are rebuilt; anything else is ``item.to(device)``."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)
