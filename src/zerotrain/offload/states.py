"""``engine.offload_states`` / ``reload_states``: training states moved to the host and back
(DeepSpeed's API; RLHF frameworks free the accelerator's memory with it between training and
generation).

Note: moving storages, not tensors
    A stage's tensors alias one another: stage 3's master views and ``ds_master`` are slices
    of a unit's master, fp32 training without offload makes a unit's shard *be* its master,
    and the optimizer's state is keyed by the master view objects. Replacing one tensor
    would split an alias silently (the step would update a copy the parameters never see).
    So the mover moves *storages*: each storage under the named states (the roots) is copied
    whole to the host, and every tensor object the stage holds on it (the views) is
    re-pointed, through ``.data``, at the same offset, size and strides of the copy; object
    identities, and so optimizer keys and every alias, stay. ``reload_states`` does the
    reverse into new device storage. Values are copied both ways, so training after a
    reload is the training that would have happened without the round trip, bit for bit,
    also in the middle of an accumulation window (gradient buffers keep their sums; where
    DeepSpeed drops its contiguous gradient buffer, zerotrain keeps it).

    A storage is tagged with every kind that has a root on it (an aliased shard moved as
    ``lp_params`` takes ``hp_params`` with it); the engine refuses forward while parameters
    are away and backward and step while anything is, naming ``reload_states()``.

    With ``pin_memory`` the host copies are page-locked buffers, kept after a reload and
    reused by the next ``offload_states`` of the same sizes (as DeepSpeed keeps its pinned
    buffers), so an RLHF loop allocates them once; pageable copies are dropped at reload.
    ``non_blocking`` issues the copies asynchronously on the current stream (pinned memory
    only; the caller synchronizes before reading them on the host).

    The ledger (:class:`MoveLedger`) counts what moved, by kind and direction: on a CPU run
    the host *is* the device and nothing moves (``crosses``), so tests build the mover with
    the crossing forced and read the ledger.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import torch

from ..errors import StateError

# DeepSpeed's OffloadStateTypeEnum values (``offload_names``, a module of the same row)
KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
HOST = torch.device("cpu")


def crosses(device: torch.device) -> bool:
    """Whether states on ``device`` can move to the host at all (a CPU run has them there)."""
    return device.type != HOST.type


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """Raw host bytes for one storage's copy (page-locked when ``pin``)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


@dataclass
class MoveLedger:
    """Bytes and storages moved, by kind and direction (``to_host``, ``to_device``)."""

    nbytes: Counter = field(default_factory=Counter)
    storages: Counter = field(default_factory=Counter)
    pinned: int = 0          # host buffers taken page-locked
    reused: int = 0          # of those, buffers kept from an earlier offload

    def record(self, direction: str, kinds: Iterable[str], nbytes: int) -> None:
        for kind in kinds:
            self.nbytes[(kind, direction)] += nbytes
            self.storages[(kind, direction)] += 1

    def snapshot(self) -> dict:
        return {"bytes": {f"{k}/{d}": n for (k, d), n in sorted(self.nbytes.items())},
                "storages": {f"{k}/{d}": n for (k, d), n in sorted(self.storages.items())},
                "pinned": self.pinned, "reused": self.reused}


@dataclass
class _Moved:
    """One storage on the host: where it came from, its copy, and the objects viewing it."""

    device: torch.device
    host: torch.Tensor            # uint8, the storage's bytes
    views: list[torch.Tensor]
    kinds: frozenset[str]
    pinned: bool


def parse_include(include) -> list[str]:
    """``include`` as kind names (None: every kind); unknown names are refused by name."""
    if include is None:
        return list(KINDS)
    if isinstance(include, str):   # one name, or one member of the (str) enum
        include = [include]
    names = []
    for item in include:
        name = str(getattr(item, "value", item))
        if name not in KINDS:
            raise ValueError(f"offload_states(include=...): unknown state {item!r}; "
                             f"one of {', '.join(KINDS)} (OffloadStateTypeEnum)")
        names.append(name)
    return names


class StateMover:
    """Moves a stage's named states to the host and back (Note: moving storages)."""

    def __init__(self, device: torch.device, *, force_crossing: bool = False) -> None:
        self.device = torch.device(device)
        self.crosses = force_crossing or crosses(self.device)
        self.ledger = MoveLedger()
        self._moved: list[_Moved] = []
        self._pool: dict[int, list[torch.Tensor]] = {}   # kept pinned buffers, by size

    @property
    def away(self) -> frozenset[str]:
        """The kinds with a storage on the host now."""
        return frozenset(k for moved in self._moved for k in moved.kinds)

    def offload(self, roots: Mapping[str, Sequence[torch.Tensor]],
                views: Sequence[torch.Tensor], include: Sequence[str], *,
                pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Move the storages under ``roots[kind]`` for each kind in ``include`` (kinds away
        already are skipped, as in DeepSpeed), re-pointing every object in ``views`` (and
        the roots) that views them."""
        if not self.crosses:
            return
        wanted = [k for k in include if k not in self.away]
        kinds_of: dict[int, set[str]] = {}
        for kind, tensors in roots.items():
            for t in tensors:
                if t is not None and t.device == self.device and _nbytes(t):
                    kinds_of.setdefault(_key(t), set()).add(kind)
        chosen = {key for key, kinds in kinds_of.items() if kinds & set(wanted)}
        if not chosen:
            return
        every = list(views) + [t for tensors in roots.values() for t in tensors]
        by_storage = _views_by_storage(every, chosen)
        pin = pin_memory and torch.cuda.is_available()
        for key, objects in by_storage.items():
            storage = objects[0].untyped_storage()
            host = self._take(storage.nbytes(), pin)
            host.copy_(_bytes_of(storage, self.device), non_blocking=non_blocking and pin)
            _repoint(objects, host)
            kinds = frozenset(kinds_of[key])
            self.ledger.record("to_host", kinds, storage.nbytes())
            self._moved.append(_Moved(self.device, host, objects, kinds, pin))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()   # the device storages are free now: give them back

    def reload(self, *, non_blocking: bool = False) -> None:
        """Every moved storage back on the device, its views re-pointed; pinned host copies
        are kept for the next offload."""
        moved, self._moved = self._moved, []
        for item in moved:
            back = torch.empty(item.host.numel(), dtype=torch.uint8, device=item.device)
            back.copy_(item.host, non_blocking=non_blocking and item.pinned)
            _repoint(item.views, back)
            self.ledger.record("to_device", item.kinds, item.host.numel())
            if item.pinned:
                self._pool.setdefault(item.host.numel(), []).append(item.host)

    def _take(self, nbytes: int, pin: bool) -> torch.Tensor:
        kept = self._pool.get(nbytes) if pin else None
        if kept:
            self.ledger.pinned += 1
            self.ledger.reused += 1
            return kept.pop()
        if pin:
            self.ledger.pinned += 1
        return host_buffer(nbytes, pin)

    def tensors(self) -> list[torch.Tensor]:
        """Host buffers held now (moved states, and pinned buffers kept for reuse)."""
        return [m.host for m in self._moved] + [t for ts in self._pool.values() for t in ts]


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _views_by_storage(tensors: Sequence[torch.Tensor], keys: set[int]
                      ) -> dict[int, list[torch.Tensor]]:
    """Distinct objects (by identity) on each storage of ``keys``."""
    out: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if t is None or id(t) in seen or not _nbytes(t):
            continue
        key = _key(t)
        if key in keys:
            seen.add(id(t))
            out.setdefault(key, []).append(t)
    return out


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _repoint(objects: Sequence[torch.Tensor], raw: torch.Tensor) -> None:
    """Each object now views ``raw``'s storage where it viewed the old one."""
    storage = raw.untyped_storage()
    for obj in objects:
        view = torch.empty(0, dtype=obj.dtype, device=raw.device).set_(
            storage, obj.storage_offset(), obj.size(), obj.stride())
        obj.data = view


def requested_kinds(include, device, *, param_offloaded: bool, inference_only: bool
                    ) -> Optional[list[str]]:
    """The kinds ``offload_states(include=..., device=...)`` moves, checked as DeepSpeed
    checks them; None for ``device="none"`` (DeepSpeed warns and moves nothing)."""
    where = str(getattr(device, "value", device))
    if where == "none":
        return None
    if where == "nvme":
        raise StateError("offload_states(device='nvme'): only 'cpu' is supported (as in "
                         "DeepSpeed, states move to host memory)")
    if where != "cpu":
        raise StateError(f"offload_states(device={device!r}): only 'cpu' is supported")
    if inference_only:
        raise StateError("offload_states() moves training states: this engine was built "
                         "without an optimizer and has none")
    if param_offloaded:
        raise StateError("offload_states() with zero_optimization.offload_param: the "
                         "parameter shards live on the host already; moving states across "
                         "devices is not supported for offloaded parameters (as in DeepSpeed)")
    return parse_include(include)


def refuse_while_away(mover: StateMover, call: str, *, parameters_only: bool = False) -> None:
    """A StateError naming ``reload_states()`` when ``call`` would use states on the host:
    any state for backward and step, the parameters for forward."""
    away = mover.away
    if parameters_only:
        away = away & {"lp_params", "hp_params"}
    if away:
        raise StateError(f"engine.{call} while engine.offload_states() has moved "
                         f"{', '.join(sorted(away))} to the host; call "
                         "engine.reload_states() first")
