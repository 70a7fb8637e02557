"""What every schedule shares: the batch counter, writing lrs into the optimizer, the
state dict; and the warmup schedules' ``warmup_num_steps``/``warmup_type``."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..errors import StateError
from .checks import _as_float, _check_int, _check_warmup_type, _param_groups


class _Stepped:
    """Shared step/state plumbing; subclasses define ``get_lr`` for ``last_batch_iteration``."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.param_groups = _param_groups(optimizer)
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, -1)
        self._last_lr: Optional[list[float]] = None

    def _start(self) -> None:
        """DeepSpeed's constructor hook: a fresh run writes the pre-first-batch lr at once."""
        if self.last_batch_iteration == -1:
            self._apply(self.get_lr())

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep the tensor (compiled/capturable optimizers)
            else:
                group["lr"] = lr
        self._last_lr = [_as_float(group["lr"]) for group in self.param_groups]

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Move to ``last_batch_iteration`` (default: the next batch) and write its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer."""
        if self._last_lr is None:
            raise StateError("get_last_lr() needs a step() first (the schedule was "
                             "constructed with last_batch_iteration != -1)")
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def check_state_dict(self, state: dict) -> None:
        """Raise ConfigError where :meth:`load_state_dict` would, changing nothing: a
        checkpoint load checks every value before it writes any (``staged_load.py``)."""
        _check_int("last_batch_iteration", state["last_batch_iteration"], -1)

    def load_state_dict(self, state: dict) -> None:
        """Restore the counter only, as DeepSpeed does; the next ``step()`` writes the lr."""
        self.check_state_dict(state)
        self.last_batch_iteration = state["last_batch_iteration"]


class _Schedule(_Stepped):
    """The warmup schedules' shared ``warmup_num_steps``/``warmup_type`` handling."""

    def __init__(self, optimizer: Any, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_int("warmup_num_steps", warmup_num_steps, 1)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    def _warmup_fraction(self) -> float:
        """Progress through warmup in [0, 1) for an iteration inside the warmup window."""
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps
