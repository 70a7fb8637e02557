"""Read DeepSpeed's ``torch.save`` files without running any pickled code.

Note: what a DeepSpeed pickle may name
    A pickle runs code by naming a global (``os.system``, ``builtins.eval``) and calling it.
    DeepSpeed's files name only a handful: torch's tensor rebuilders and storage types,
    ``torch.Size``, ``collections.OrderedDict``, and four DeepSpeed classes (its loss
    scalers, ``ZeroStageEnum`` and ``fragment_address``). :class:`_Unpickler` resolves
    exactly :data:`_ALLOWED` to the real object (functions that only build tensors or
    containers), maps :data:`_RECORDS` to :class:`DeepSpeedRecord` subclasses (inert data:
    constructing, calling or restoring one only stores its arguments and state, so DeepSpeed
    need not be installed), and refuses every other global with a :class:`CheckpointError`
    naming the global and the file. ``torch.load`` is given this unpickler through
    ``pickle_module``; it resolves storage types itself (names containing ``Storage`` map to
    a dtype, nothing is imported) and asks us for everything else. TorchScript archives,
    which ``torch.load`` would hand to ``torch.jit.load``, and the pre-1.6 non-zip format are
    refused before ``torch.load`` sees them.
"""
from __future__ import annotations

import codecs
import collections
import pickle
import zipfile
from typing import Any

import torch

from ..manifest import CheckpointError

def _rebuild_from_type_v2(func: Any, new_type: Any, args: tuple, state: Any) -> torch.Tensor:
    """torch's rebuilder for tensors carrying Python attributes (DeepSpeed's stage-3 flat
    partitions), restricted: ``func`` must be a tensor rebuilder and ``new_type`` a plain
    tensor or parameter; the attributes (DeepSpeed's bookkeeping) are dropped."""
    if func not in _TENSOR_REBUILDERS or new_type not in (torch.Tensor, torch.nn.Parameter):
        raise RefusedGlobal(getattr(new_type, "__module__", "?"),
                            getattr(new_type, "__qualname__", repr(new_type)))
    return func(*args)


_TENSOR_REBUILDERS = (torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter)
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("_codecs", "encode"): codecs.encode,   # how protocol 2 writes ``bytes``
}
_ALLOWED.update({("torch", name): getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool")})

_RECORDS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class DeepSpeedRecord:
    """An object of a known DeepSpeed class, kept as data: ``qualname`` (the class it was),
    ``args`` (what it was constructed with) and ``state`` (what it restored)."""

    __slots__ = ("args", "state")
    qualname = ""

    def __new__(cls, *args: Any) -> "DeepSpeedRecord":
        record = object.__new__(cls)
        record.args, record.state = args, None
        return record

    def __init__(self, *args: Any) -> None:
        """Construction stores the arguments (``__new__``) and does nothing else."""

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def attributes(self) -> dict:
        """The object's attributes as saved (``__dict__`` and ``__slots__`` merged)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:   # (dict, slots) form
            merged = dict(state[0] or {})
            merged.update(state[1] or {})
            return merged
        return dict(state) if isinstance(state, dict) else {}

    def __repr__(self) -> str:
        return f"DeepSpeedRecord({self.qualname}, args={self.args!r}, state={self.state!r})"


_RECORD_CLASSES = {tuple(name.rsplit(".", 1)): type(name.rsplit(".", 1)[1], (DeepSpeedRecord,),
                                                     {"__slots__": (), "qualname": name})
                   for name in _RECORDS}


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside the allowlist (see Note: what a DeepSpeed pickle may
    name)."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module = module
        self.name = name
        self.qualname = f"{module}.{name}"

    def __reduce__(self):  # rebuilt from (module, name), not from args, so it pickles
        return (type(self), (self.module, self.name), self.__dict__)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _ALLOWED:
            return _ALLOWED[key]
        if key in _RECORD_CLASSES:
            return _RECORD_CLASSES[key]
        raise RefusedGlobal(module, name)


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` needs: ``Unpickler`` and ``load``."""

    __name__ = "zerotrain.checkpoint.deepspeed.unpickle"
    Unpickler = _Unpickler
    UnpicklingError = pickle.UnpicklingError

    @staticmethod
    def load(file, **kwargs: Any) -> Any:
        return _Unpickler(file, **kwargs).load()


def load_file(path: str, *, mmap: bool = True) -> Any:
    """The object in DeepSpeed file ``path``, read without running pickled code.

    With ``mmap`` tensors are views of the mapped file: only the elements read later are
    paged in, so opening a large optimizer-state file costs almost no memory.
    Raises CheckpointError naming the file (and the global, for a refused one).
    """
    _check_archive(path)
    try:
        return torch.load(path, map_location="cpu", pickle_module=_PickleModule,
                          weights_only=False, mmap=mmap)
    except RefusedGlobal as exc:
        raise CheckpointError(
            f"refusing to read {path}: its pickle names the global {exc.qualname}, which "
            "is not one of the DeepSpeed, torch or collections classes a DeepSpeed "
            "checkpoint holds; zerotrain never runs pickled code") from None
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any other failure is a corrupt file
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: "
                              f"{type(exc).__name__}: {exc}") from exc


def _check_archive(path: str) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except FileNotFoundError:
        raise CheckpointError(f"DeepSpeed checkpoint file {path} is missing") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(f"{path} is not a torch.save zip archive ({exc}); only the "
                              "zip format (torch >= 1.6, what DeepSpeed writes) is read") from None
    if any(name.endswith("/constants.pkl") or "/code/" in name for name in names):
        raise CheckpointError(f"refusing to read {path}: it is a TorchScript archive, which "
                              "holds code; DeepSpeed checkpoints never are")
