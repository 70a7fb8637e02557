"""The speculative host step: a record's Adam step taken while backward still runs, kept
only if the step's own checks agree.

Note: speculation then validation
    With ``offload_optimizer.speculative`` each record's gradient, once on the host, is
    stepped at once on a worker thread, assuming the step will neither clip nor skip: the
    gradient was finished on the device with ``1 / loss scale`` (the factor of the step
    before; ``1`` at first) and the optimizer's group hyperparameters as they stand. Before
    stepping, the record's state (master, every tensor of its optimizer state) is copied
    aside (``keep``). At the step, once the global norm is known, a speculative step stands
    when the step's factor, world and hyperparameters are the ones it assumed: then it is
    exactly the step the host would take now, the same kernel on the same values. Otherwise
    (clipping applies, the loss scale changed, the learning rate was changed after
    backward) the record's state is copied back (``restore``) and it is stepped again with
    the right gradient. A skipped step (inf/nan), ``zero_grad``, and anything that reads or
    writes the state between backward and step (checkpoints, ``GatheredParameters``,
    ``eval()``: they all ``settle`` first) restore every record stepped speculatively, so
    nothing outside the step ever sees an unvalidated update. Results are therefore bit for
    bit those of the step without speculation, in every case; what speculation costs is the
    copy aside, 12 bytes read and 12 written per parameter (for Adam), and 12 bytes per
    parameter of host memory (files, with NVMe) to hold it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .traffic import HostTraffic, nbytes


@dataclass(slots=True)
class _Kept:
    """One record's state from before its speculative step, and what that step assumed."""

    master: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    had_state: bool = True
    coef: float = 1.0
    world: int = 1
    hyper: dict = field(default_factory=dict)
    valid: bool = False   # set once the step finished


class KeptStates:
    """Copies of records' state from before their speculative step (Note above)."""

    def __init__(self, allocate: Callable[[int, torch.dtype], torch.Tensor],
                 traffic: HostTraffic) -> None:
        self._allocate = allocate     # the storage's own memory: RAM, or NVMe files
        self._traffic = traffic
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}   # reused step to step
        self.kept: dict[int, _Kept] = {}

    def keep(self, k: int, master: torch.Tensor, state: dict, group: dict) -> _Kept:
        """Copy record k's master and tensor state aside (``keep`` traffic)."""
        kept = _Kept(self._copy(k, "master", master), had_state=bool(state),
                     hyper=hyperparameters(group))
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                kept.state[key] = self._copy(k, key, value)
        self.kept[k] = kept
        return kept

    def restore(self, k: int, master: torch.Tensor, state: dict) -> None:
        """Put record k's state back as it was before its speculative step."""
        kept = self.kept.pop(k)
        self._put(master, kept.master)
        if not kept.had_state:
            state.clear()   # the optimizer allocates it afresh, as on a first step
            return
        for key, value in kept.state.items():
            if isinstance(state.get(key), torch.Tensor):
                self._put(state[key], value)
            else:
                state[key] = value.clone()

    def stands(self, k: int, *, coef: float, world: int, group: dict) -> bool:
        """Whether record k's speculative step is the step the host would take now."""
        kept = self.kept[k]
        return (kept.valid and kept.coef == coef and kept.world == world
                and _same(kept.hyper, hyperparameters(group)))

    def reserve(self, k: int, tensors: dict[str, torch.Tensor]) -> None:
        """Allocate record k's kept copies up front (NVMe: the space is reserved at
        ``initialize``, never discovered mid-step)."""
        for key, value in tensors.items():
            self._buffers[(k, key)] = self._allocate(value.numel(), value.dtype)

    def _copy(self, k: int, key: str, value: torch.Tensor) -> torch.Tensor:
        if value.dim() == 0 or value.numel() < 2:
            return value.detach().clone()
        buffer = self._buffers.get((k, key))
        if buffer is None or buffer.numel() != value.numel() or buffer.dtype != value.dtype:
            buffer = self._buffers[(k, key)] = self._allocate(value.numel(), value.dtype)
        flat = buffer.view(value.shape)
        flat.copy_(value)
        self._traffic.record("keep", read=nbytes(value), written=nbytes(value))
        return flat

    def _put(self, target: torch.Tensor, kept: torch.Tensor) -> None:
        target.copy_(kept)
        if kept.numel() >= 2:
            self._traffic.record("restore", read=nbytes(kept), written=nbytes(kept))

    def tensors(self) -> list[torch.Tensor]:
        return list(self._buffers.values())


def hyperparameters(group: dict) -> dict:
    """A group's entries besides its parameters, as the step reads them."""
    return {key: (value.detach().clone() if isinstance(value, torch.Tensor) else value)
            for key, value in group.items() if key != "params"}


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_equal(a[key], b[key]) for key in a)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    try:
        return bool(a == b)
    except Exception:   # an entry that does not compare: assume it changed
        return False


