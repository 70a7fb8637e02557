"""One restricted unpickler for every foreign pickle zerotrain reads (DCP's ``.metadata``).

A pickle runs code by naming a global and calling it. :func:`restricted_loads` resolves only
the ``(module, name)`` pairs of an allowlist the caller passes (objects that only build data)
and refuses every other global with a :class:`CheckpointError` naming the global and the
file, before anything it names is imported. Classes of the foreign library are mapped to
:class:`InertRecord` subclasses (:func:`inert_classes`): constructing or restoring one only
stores its arguments and state, so the library need not be installed and its code never runs.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Mapping

from .manifest import CheckpointError


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside the allowlist."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module = module
        self.name = name
        self.qualname = f"{module}.{name}"

    def __reduce__(self):  # rebuilt from (module, name), not from args, so it pickles
        return (type(self), (self.module, self.name), self.__dict__)


class InertRecord:
    """An object of a known foreign class, kept as data: ``args`` (what it was constructed
    with) and ``state`` (what it restored); attribute reads go to the state dict."""

    qualname = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> "InertRecord":
        record = object.__new__(cls)
        object.__setattr__(record, "args", args)
        object.__setattr__(record, "state", None)
        return record

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Construction stores the arguments (``__new__``) and does nothing else."""

    def __setstate__(self, state: Any) -> None:
        object.__setattr__(self, "state", state)

    def fields(self) -> dict:
        """The saved attributes (``__dict__`` and ``__slots__`` forms merged)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:
            merged = dict(state[0] or {})
            merged.update(state[1] or {})
            return merged
        return dict(state) if isinstance(state, dict) else {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        fields = self.fields()
        if name in fields:
            return fields[name]
        raise AttributeError(f"{self.qualname} saved no field {name!r}")

    def __repr__(self) -> str:
        return f"{self.qualname}({self.fields() or self.args!r})"

    def __hash__(self) -> int:
        return hash((self.qualname, repr(self.args), repr(sorted(self.fields().items()))))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, InertRecord) and self.qualname == other.qualname
                and self.args == other.args and self.fields() == other.fields())


def inert_classes(qualnames: tuple[str, ...]) -> dict[tuple[str, str], type]:
    """``{(module, name): InertRecord subclass}`` for each dotted class name."""
    return {tuple(q.rsplit(".", 1)): type(q.rsplit(".", 1)[1], (InertRecord,), {"qualname": q})
            for q in qualnames}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, allowed: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        raise RefusedGlobal(module, name)


def restricted_loads(data: bytes, allowed: Mapping[tuple[str, str], Any], *, path: str,
                     what: str) -> Any:
    """Unpickle ``data`` (read from ``path``) resolving only ``allowed``; ``what`` names the
    format in errors. Raises CheckpointError naming the file (and the refused global)."""
    try:
        return _Unpickler(io.BytesIO(data), allowed).load()
    except RefusedGlobal as exc:
        raise CheckpointError(
            f"refusing to read {path}: its pickle names the global {exc.qualname}, which is "
            f"not one of the classes a {what} holds; zerotrain never runs pickled code"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any other failure is a corrupt file
        raise CheckpointError(f"cannot read {what} file {path}: "
                              f"{type(exc).__name__}: {exc}") from None
