"""Adam's moments in NVMe files, beside their master, for the host step.

Apart from the updater because it is the one part of the host step that depends on the
optimizer's state layout: with NVMe each master's ``exp_avg`` and ``exp_avg_sq`` get files
of their own (Note "NVMe swapping" in ``nvme.py``), allocated up front, read with the
master into a slot before the record steps, and put back in place after anything (a
checkpoint load) replaced them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import ConfigError
from .host_storage import HostStorage
from .speculation import KeptStates

ADAM_STATE = ("exp_avg", "exp_avg_sq")


class SwappedAdamState:
    """Each master's Adam state, kept in files of ``storage`` (an ``NvmeStorage``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, storage: HostStorage) -> None:
        self.optimizer = optimizer
        self.storage = storage
        # id(master) -> its state's files, held here too: the files stay reserved whatever
        # replaces the state's entries
        self.homes: dict[int, dict[str, torch.Tensor]] = {}

    def allocate(self, masters: Sequence[torch.Tensor], kept: Optional[KeptStates]) -> None:
        """Give each master its optimizer state up front, in files (the optimizer then
        finds it and does not allocate), and size the storage's slots for the largest
        record. ``kept`` (speculative steps): each record's files for its kept state are
        reserved right after its own. ConfigError for an optimizer other than Adam/AdamW."""
        for group in self.optimizer.param_groups:
            if type(self.optimizer).__name__ not in ("Adam", "AdamW") or group.get("amsgrad"):
                raise ConfigError("zero_optimization.offload_optimizer.device",
                                  '"nvme" swaps Adam/AdamW state (exp_avg, exp_avg_sq); '
                                  f"{type(self.optimizer).__name__}"
                                  f"{' with amsgrad' if group.get('amsgrad') else ''} "
                                  'is not supported there; use device "cpu"', value="nvme")
        numel = 0
        for k, master in enumerate(masters):
            state = self.optimizer.state[master]
            state.setdefault("step", torch.zeros((), dtype=torch.float32))
            self.homes[id(master)] = {key: self.storage.zeros(master.numel())
                                      for key in ADAM_STATE}
            state.update(self.homes[id(master)])
            numel = max(numel, master.numel() * (1 + len(ADAM_STATE)))
            if kept is not None:   # the files for the kept state are reserved now too
                kept.reserve(k, {"master": master, **self.homes[id(master)]})
        self.storage.reserve_slots(numel)

    def prefetch(self, k: int, master: torch.Tensor) -> None:
        """Start reading record k (``master`` and its state) into a slot; nothing to do
        unless the storage swaps."""
        if not self.storage.swaps:
            return
        state = self._adopted_state(master)
        self.storage.prefetch(k, [master] + [state[key] for key in ADAM_STATE])

    def _adopted_state(self, master: torch.Tensor) -> dict:
        """The master's state, back in its NVMe files if something (a checkpoint load)
        replaced or dropped an entry: values are copied in, and a missing entry (a load
        without optimizer state) starts from zero, as a fresh Adam would."""
        state = self.optimizer.state[master]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for home in self.homes[id(master)].values():
                home.zero_()
        for key, home in self.homes[id(master)].items():
            value = state.get(key)
            if value is not home:
                if value is not None:
                    home.copy_(value)
                state[key] = home
        return state
