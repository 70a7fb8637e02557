"""Read DeepSpeed's ``torch.save`` files without running any pickled code.

Note: what a DeepSpeed pickle may name
    A pickle runs code by naming a global (``os.system``, ``builtins.eval``) and calling it,
    or by setting attributes on one it may name (a BUILD opcode on a function can rewrite
    its ``__defaults__`` for the whole process). DeepSpeed's files are read by torch's own
    weights-only unpickler (``torch.load(weights_only=True)``), which allows torch's tensor
    rebuilders, storage and dtype types, ``torch.Size`` and ``collections.OrderedDict``,
    and builds (BUILD) only tensors, parameters, ordered dicts and allowlisted classes.
    Four DeepSpeed classes (its loss scalers, ``ZeroStageEnum`` and ``fragment_address``)
    and ``frozenset`` are added for the duration of one read only
    (``torch.serialization.safe_globals``), each DeepSpeed class mapped to a
    :class:`DeepSpeedRecord` subclass (inert data: constructing, calling or restoring one
    only stores its arguments and state, so DeepSpeed need not be installed). Every other
    global is refused with a :class:`CheckpointError` naming the global and the file.
    The file is opened through ``untrusted.open_file`` (a regular file inside its folder:
    no FIFO, no ``/dev/zero``, no symlink out) and read through ``restricted.load_torch``,
    which refuses TorchScript archives (``torch.load`` would hand them to
    ``torch.jit.load``), the pre-1.6 non-zip format, zip bombs and pickles whose work is
    unbounded (a hash bomb) before ``torch.load`` sees the file. Compressed records are
    read without ``mmap`` (mapping would hand out the compressed bytes as tensor data).
"""
from __future__ import annotations

import os
import pickle
import re
from typing import Any, Optional

from ... import untrusted
from ..manifest import CheckpointError
from ..restricted import load_torch

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


_SAFE = [(cls, cls.qualname) for cls in _RECORD_CLASSES.values()] + [frozenset]
_UNSUPPORTED = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)")


def load_file(path: str, *, mmap: bool = True, root: Optional[str] = None) -> Any:
    """The object in DeepSpeed file ``path``, read without running pickled code.

    The file is opened through the one opener (``untrusted.open_file``: a regular file
    whose real path lies inside ``root``, by default the file's own folder) and its pickle
    pre-scanned (``restricted.load_torch``) before torch's weights-only unpickler reads it.
    With ``mmap`` tensors are views of the mapped file: only the elements read later are
    paged in, so opening a large optimizer-state file costs almost no memory (a file with
    compressed records is read whole instead).
    Raises CheckpointError naming the file (and the global, for a refused one).
    """
    what = "DeepSpeed checkpoint file"
    try:
        with untrusted.open_file(path, what=what,
                                 root=os.path.dirname(path) if root is None else root) as f:
            return load_torch(f, path=path, what=what, extra_globals=_SAFE, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except untrusted.UnsafeFile as exc:
        raise CheckpointError(str(exc)) from None
    except pickle.UnpicklingError as exc:
        found = _UNSUPPORTED.search(str(exc))
        if found:
            name = found.group(1)
            raise CheckpointError(
                f"refusing to read {path}: its pickle names the global {name}, which is not "
                "one of the DeepSpeed, torch or collections classes a DeepSpeed checkpoint "
                "holds; zerotrain never runs pickled code") from None
        raise CheckpointError(f"refusing to read {path}: {_first_line(exc)} (torch's "
                              "weights-only unpickler refused it; zerotrain never runs "
                              "pickled code)") from None
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any other failure is a corrupt file
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: "
                              f"{type(exc).__name__}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    if "Weights only load failed" in text:   # torch's long advice: keep the reason only
        lines = [line for line in text.splitlines() if line.strip()]
        reason = [line for line in lines[1:] if not line.startswith("Check the documentation")]
        return (reason or lines[-1:] or [text])[0].strip()
    return text.splitlines()[0] if text else type(exc).__name__
