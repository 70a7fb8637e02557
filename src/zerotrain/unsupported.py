"""Names of DeepSpeed features zerotrain does not implement, importable but unusable.

Training scripts import such names at the top even when a flag leaves them unused (a
script imports ``deepspeed.pipe`` and uses it only with ``--pipeline``). So
``zerotrain.pipe`` imports, and any name taken from it imports too;
calling it, instantiating it (or a subclass of it) raises :class:`UnsupportedFeatureError`
naming the feature, never a ``ModuleNotFoundError`` or an ``AttributeError``.
"""
from __future__ import annotations

from typing import Any, Callable

from .errors import ZeroTrainError

__all__ = ["UnsupportedFeatureError", "stub_getattr"]


class UnsupportedFeatureError(ZeroTrainError, NotImplementedError):
    """A DeepSpeed feature outside zerotrain's scope (ZeRO data parallelism) was used."""


def _stub(qualname: str, feature: str) -> type:
    message = (f"{qualname} is part of DeepSpeed's {feature}, which zerotrain does not "
               "implement: zerotrain is ZeRO data parallelism (stages 0-3, offload) only")

    def refuse(cls, *args: Any, **kwargs: Any):
        raise UnsupportedFeatureError(message)

    return type(qualname.rpartition(".")[2], (), {
        "__new__": refuse, "__doc__": message, "__module__": qualname.rpartition(".")[0]})


def stub_getattr(module_name: str, feature: str) -> Callable[[str], type]:
    """A module ``__getattr__`` (PEP 562) handing out stubs for every public name."""
    public = module_name.replace("zerotrain.", "", 1)

    def __getattr__(name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{public}.{name}", feature)
    return __getattr__
