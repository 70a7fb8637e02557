"""The one bounded unpickler path: every pickle zerotrain reads (DCP's ``.metadata``, a
DCP chunk, DeepSpeed's ``.pt`` files) is scanned here first, then unpickled here.

Note: the pre-scan bounds the work, not only the bytes
    A few hundred bytes of pickle can make the unpickler, or whoever later hashes, compares
    or prints what it built, work for ever: a tuple memoized once and fetched twice per
    level (``t1 = (t0, t0)``, ``t2 = (t1, t1)``, ...) is 2**60 tuples to hash when used as a
    dict key, and the same list passed to a callable that prints it is as bad.
    :func:`scan_pickle` walks the opcode stream (``pickletools.genops``) without building
    anything: it refuses more than :data:`MAX_OPS` opcodes, a length that runs past the
    data, a memo fetch of a slot never stored, and, after simulating the stack with one
    node per container, any object whose expansion (its size with every shared reference
    counted again, which is what hashing, ``==`` and ``repr`` walk) exceeds
    :data:`MIN_EXPANSION` or :data:`EXPANSION_PER_BYTE` times the pickle's bytes, or whose
    nesting is deeper than :data:`MAX_DEPTH`: as each container is built (most bombs stop
    within a few hundred opcodes), and once more over the whole graph at the end (a
    container filled after it was shared). All of it is linear in the pickle's size.
    torch archives (``torch.save``'s zip) have their ``data.pkl`` records scanned before
    ``torch.load`` (weights-only) sees the file (:func:`load_torch`).

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
import pickletools
import threading
import zipfile
from typing import Any, Mapping, Sequence

from .manifest import CheckpointError

MAX_OPS = 1 << 24            # a DCP .metadata of 100k tensors is ~2M opcodes
MAX_DEPTH = 400              # below the interpreter's recursion limit, for repr and hash
MIN_EXPANSION = 1 << 22      # ~4M nodes to walk: tens of milliseconds
EXPANSION_PER_BYTE = 8
INFLATE_RATIO = 64           # declared size of compressed zip records per byte of archive
_ATOM = -1


class UnsafePickle(pickle.UnpicklingError):
    """The pickle would cost more work than any file of its kind needs, or is malformed."""


def scan_pickle(data: bytes, *, max_ops: int = MAX_OPS) -> None:
    """Raise :class:`UnsafePickle` unless unpickling ``data`` and walking the result is
    bounded (Note: the pre-scan bounds the work, not only the bytes)."""
    children: list[list[int]] = []
    sizes: list[int] = []    # lower bounds while scanning (a container may grow later)
    depths: list[int] = []
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    limit = max(MIN_EXPANSION, EXPANSION_PER_BYTE * len(data))
    floor = 0   # the stack may not be popped below the innermost MARK

    def grow(at: int, kids: list[int]) -> None:
        size, depth = sizes[at], depths[at]
        for kid in kids:
            if kid >= 0:
                size += sizes[kid]
                if depths[kid] >= depth:
                    depth = depths[kid] + 1
            else:
                size += 1
        sizes[at], depths[at] = size, depth
        if size > limit or depth > MAX_DEPTH:
            _refuse_over(size, depth, limit)

    def new(kids: list[int]) -> int:
        children.append(kids)
        sizes.append(1)
        depths.append(1)
        grow(len(children) - 1, kids)
        return len(children) - 1

    def pop(count: int) -> list[int]:
        if len(stack) - count < floor:
            raise UnsafePickle("pops below its stack (malformed)")
        items = stack[len(stack) - count:]
        del stack[len(stack) - count:]
        return items

    ops = 0
    try:
        for op, arg, _ in pickletools.genops(data):
            ops += 1
            kind = _KIND.get(op.name, _UNKNOWN)
            if kind == _PUSH_ATOM:
                stack.append(_ATOM)
            elif kind == _MEMO_GET:
                if arg not in memo:
                    raise UnsafePickle(f"fetches memo slot {arg}, which was never stored")
                stack.append(memo[arg])
            elif kind == _MEMO_PUT:
                if len(stack) <= floor:
                    raise UnsafePickle("memoizes an empty stack (malformed)")
                memo[len(memo) if arg is None else arg] = stack[-1]
            elif kind == _MARK:
                marks.append(len(stack))
                floor = len(stack)
            elif kind in (_BUILD_FROM_MARK, _ADD_FROM_MARK):
                if not marks:
                    raise UnsafePickle("has no MARK where one is needed (malformed)")
                start = marks.pop()
                floor = marks[-1] if marks else 0
                items = stack[start:]
                del stack[start:]
                if kind == _BUILD_FROM_MARK:
                    stack.append(new(items))
                elif len(stack) <= floor:
                    raise UnsafePickle("adds items to nothing (malformed)")
                elif stack[-1] != _ATOM:
                    children[stack[-1]].extend(items)
                    grow(stack[-1], items)
            elif kind == _EMPTY:
                stack.append(new([]))
            elif kind > 0:   # pop ``kind`` items and push one node made of them
                stack.append(new(pop(kind)))
            elif kind == _ADD:   # APPEND, SETITEM, BUILD: items into the object below
                items = pop(2 if op.name == "SETITEM" else 1)
                if len(stack) <= floor:
                    raise UnsafePickle("adds items to nothing (malformed)")
                if stack[-1] == _ATOM:
                    stack[-1] = new([_ATOM])
                children[stack[-1]].extend(items)
                grow(stack[-1], items)
            elif kind == _REPLACE:   # BINPERSID, STACK_GLOBAL: pops, pushes a value
                pop(1 if op.name == "BINPERSID" else 2)
                stack.append(_ATOM)
            elif kind == _POP:
                pop(1)
            elif kind == _POP_MARK:
                if not marks:
                    raise UnsafePickle("has no MARK where one is needed (malformed)")
                del stack[marks.pop():]
                floor = marks[-1] if marks else 0
            elif kind == _DUP:
                if len(stack) <= floor:
                    raise UnsafePickle("duplicates nothing (malformed)")
                stack.append(stack[-1])
            elif kind == _STOP:
                break
            elif kind == _UNKNOWN:
                raise UnsafePickle(f"uses the opcode {op.name}, which no checkpoint needs")
            if ops > max_ops:
                raise UnsafePickle(f"has more than {max_ops} opcodes")
    except UnsafePickle:
        raise
    except (ValueError, EOFError, OverflowError, MemoryError) as exc:   # genops: truncated
        raise UnsafePickle(f"is malformed ({exc})") from None
    _check_expansion(children, limit)


# What each opcode does to the simulated stack: a positive kind pops that many items and
# pushes one container made of them (TUPLE1-3, REDUCE, NEWOBJ, NEWOBJ_EX); the rest below.
(_PUSH_ATOM, _MEMO_GET, _MEMO_PUT, _MARK, _BUILD_FROM_MARK, _ADD_FROM_MARK, _EMPTY, _ADD,
 _REPLACE, _POP, _POP_MARK, _DUP, _STOP, _NOTHING, _UNKNOWN) = range(-1, -16, -1)
_KIND = {
    **dict.fromkeys(("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
                     "FLOAT", "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE", "STRING",
                     "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
                     "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
                     "BINBYTES8", "BYTEARRAY8", "GLOBAL", "PERSID", "EXT1", "EXT2", "EXT4",
                     "NEXT_BUFFER", "EMPTY_TUPLE"), _PUSH_ATOM),
    **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), _MEMO_GET),
    **dict.fromkeys(("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"), _MEMO_PUT),
    "MARK": _MARK,
    **dict.fromkeys(("TUPLE", "LIST", "DICT", "FROZENSET", "INST", "OBJ"), _BUILD_FROM_MARK),
    **dict.fromkeys(("APPENDS", "SETITEMS", "ADDITEMS"), _ADD_FROM_MARK),
    **dict.fromkeys(("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"), _EMPTY),
    "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3,
    **dict.fromkeys(("APPEND", "SETITEM", "BUILD"), _ADD),
    **dict.fromkeys(("BINPERSID", "STACK_GLOBAL"), _REPLACE),
    "POP": _POP, "POP_MARK": _POP_MARK, "DUP": _DUP, "STOP": _STOP,
    **dict.fromkeys(("PROTO", "FRAME", "READONLY_BUFFER"), _NOTHING),
}


def _refuse_over(size: int, depth: int, limit: int) -> None:
    if size > limit:
        raise UnsafePickle(f"builds an object that expands to more than {limit} parts "
                           "(containers shared through its memo, a hash bomb)")
    if depth > MAX_DEPTH:
        raise UnsafePickle(f"nests containers deeper than {MAX_DEPTH} levels")


def _check_expansion(children: list[list[int]], limit: int) -> None:
    """Every node's expanded size (shared references counted each time) and depth, by one
    iterative post-order walk; a cycle counts its back edge once."""
    count = len(children)
    size, depth, state = [0] * count, [0] * count, bytearray(count)   # 1 active, 2 done
    for root in range(count):
        if state[root]:
            continue
        state[root] = 1
        work = [(root, 0)]
        while work:
            at, i = work[-1]
            kids = children[at]
            if i < len(kids):
                work[-1] = (at, i + 1)
                kid = kids[i]
                if kid >= 0 and state[kid] == 0:
                    state[kid] = 1
                    work.append((kid, 0))
                continue
            work.pop()
            total, deepest = 1, 0
            for kid in kids:
                if kid >= 0 and state[kid] == 2:
                    total += size[kid]
                    deepest = max(deepest, depth[kid])
                else:
                    total += 1
            _refuse_over(total, deepest + 1, limit)
            size[at], depth[at], state[at] = total, deepest + 1, 2


def checked_pickle(data: bytes, *, path: str, what: str) -> None:
    """:func:`scan_pickle` raising CheckpointError naming the file."""
    try:
        scan_pickle(data)
    except UnsafePickle as exc:
        raise CheckpointError(f"refusing to read {what} {path}: its pickle {exc}") from None


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
    checked_pickle(data, path=path, what=what)
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


# --------------------------------------------------------------------------- torch archives
_TORCH_LOCK = threading.Lock()   # one read at a time adds and removes extra safe globals


def check_torch_archive(fileobj: Any, size: int, *, path: str, what: str) -> bool:
    """Refuse a ``torch.save`` archive that ``torch.load`` must not see: not a zip (the
    pre-1.6 format), a TorchScript archive (code), compressed records declaring far more
    than the archive holds (a zip bomb), or a pickle record that fails :func:`scan_pickle`.
    Returns whether any record is compressed (such a file cannot be memory-mapped)."""
    try:
        with zipfile.ZipFile(fileobj) as archive:
            infos = archive.infolist()
            names = [info.filename for info in infos]
            if any(name.endswith("/constants.pkl") or "/code/" in name for name in names):
                raise CheckpointError(f"refusing to read {path}: it is a TorchScript archive, "
                                      f"which holds code; a {what} never is")
            packed = [info for info in infos if info.compress_type != zipfile.ZIP_STORED]
            declared = sum(info.file_size for info in packed)
            if declared > INFLATE_RATIO * size + (1 << 20):
                raise CheckpointError(f"refusing to read {path}: its compressed records "
                                      f"declare {declared} bytes, more than {INFLATE_RATIO} "
                                      f"times the file's {size}; torch.save writes records "
                                      "uncompressed")
            pickles = [info for info in infos if info.filename.endswith(".pkl")]
            if not pickles:
                raise CheckpointError(f"{path} has no data.pkl record: not a torch.save "
                                      "archive")
            for info in pickles:
                checked_pickle(archive.read(info), path=path, what=what)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
        raise CheckpointError(f"{path} is not a torch.save zip archive ({exc}); only the zip "
                              "format (torch >= 1.6) is read") from None
    return bool(packed)


def load_torch(source: Any, *, path: str, what: str, extra_globals: Sequence[Any] = (),
               mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of ``source`` (an ``untrusted.Opened`` file or the
    bytes of one record) after :func:`check_torch_archive`; ``extra_globals`` are allowed
    for this read only. torch's errors pass through for the caller to name."""
    import torch
    target: Any
    if isinstance(source, (bytes, bytearray, memoryview)):
        check_torch_archive(io.BytesIO(source), len(source), path=path, what=what)
        target, mmap = io.BytesIO(source), False
    else:
        with source.fileobj() as handle:
            compressed = check_torch_archive(handle, source.size, path=path, what=what)
        target, mmap = source.path_for_library, mmap and not compressed
    with _TORCH_LOCK, torch.serialization.safe_globals(list(extra_globals)):
        return torch.load(target, map_location="cpu", weights_only=True, mmap=mmap)
