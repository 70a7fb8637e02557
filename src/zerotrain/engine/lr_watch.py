"""Noticing a learning-rate scheduler stepped both by the engine and by the user's loop.

``initialize(lr_scheduler=...)`` hands the scheduler to the engine, which steps it at every
update, as DeepSpeed does. A loop ported from accelerate or plain PyTorch often still calls
``scheduler.step()`` itself, so the schedule runs twice as fast and nothing fails. The
engine reads the scheduler's position (``last_epoch`` for torch schedulers,
``last_batch_iteration`` for DeepSpeed's) before each of its own steps: if it moved since
the engine's previous step, something else stepped it, and one warning names it.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

_POSITION_ATTRS = ("last_epoch", "last_batch_iteration")


def position(scheduler: Any) -> Optional[int]:
    """The scheduler's step counter, or None when it exposes none we know."""
    for attr in _POSITION_ATTRS:
        value = getattr(scheduler, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class SchedulerWatch:
    """Call :meth:`step` instead of ``scheduler.step``; :meth:`rebase` after loading."""

    def __init__(self) -> None:
        self._expected: Optional[int] = None
        self._warned = False

    def step(self, scheduler: Any, **kwargs: Any) -> None:
        before = position(scheduler)
        if (self._expected is not None and before is not None and before != self._expected
                and not self._warned):
            self._warned = True
            logger.warning(
                "the learning-rate scheduler %s was stepped outside engine.step() (its "
                "position moved from %d to %d between two updates): the engine already steps "
                "the scheduler given to initialize() at every update, so it now advances "
                "more than once per update. Remove the scheduler.step() call from the "
                "training loop.", type(scheduler).__name__, self._expected, before)
        scheduler.step(**kwargs)
        self._expected = position(scheduler)

    def rebase(self, scheduler: Any) -> None:
        """The position was set on purpose (a checkpoint was loaded)."""
        self._expected = position(scheduler) if scheduler is not None else None
