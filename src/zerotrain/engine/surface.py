"""What the engine's mixins may use of one another, declared once, with its types.

``ZeroEngine`` is put together from mixins that each do one job (``api.py``, ``reports.py``,
``persistence.py``, ``compile.py``, ``accumulation.py``, ``stepping.py``) and meet in one
object only at run time. A type checker reads each mixin alone, so each inherits
:class:`EngineSurface` while type checking: the engine's state and the members one mixin
calls on another. At run time the mixins' base is ``object`` (the module is imported only
under ``TYPE_CHECKING``), so nothing joins the engine's method resolution order.

Because the surface is a protocol the mixins subclass, its methods without a body are
abstract to mypy: a ``ZeroEngine`` missing one of them, or defining one with another
signature, fails ``make typecheck`` where it is built.
"""
from __future__ import annotations

from typing import Any, ContextManager, Optional, Protocol

import torch
from torch import nn

from .. import checkpoint
from ..comm import Communicator
from ..config import ZeroTrainConfig
from ..core.precision import LossScaling, PrecisionPolicy
from ..offload.states import StateMover
from ..optim import ZeroOptimizer
from ..stages.protocol import Stage
from .lr_watch import SchedulerWatch
from .throughput import ThroughputTimer
from .timers import StepTimers
from .vote_plan import VotePlan
from .window import AccumulationWindow


class EngineSurface(Protocol):
    """The engine's state and the members its mixins share (defined in the file named)."""

    # the engine's state (engine.py)
    module: nn.Module
    config: ZeroTrainConfig
    comm: Communicator
    stage: Stage
    policy: PrecisionPolicy
    optimizer: ZeroOptimizer
    lr_scheduler: Any          # the user's or the config's scheduler, any object with step()
    training_dataloader: Any   # the user's iterable, or the one initialize built
    loss_scaler: LossScaling
    accumulation_window: AccumulationWindow
    global_rank: int
    world_size: int
    local_rank: int
    device: torch.device
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int
    tput_timer: ThroughputTimer
    last_checkpoint_report: Optional[checkpoint.CheckpointReport]
    _timers: StepTimers
    _lr_watch: SchedulerWatch
    _moved: StateMover
    _autocast_dtype: Optional[torch.dtype]
    _vote_plan: Optional[VotePlan]

    # engine.py
    @property
    def inference_only(self) -> bool: ...
    def is_gradient_accumulation_boundary(self) -> bool: ...
    def close(self) -> None: ...
    def _refuse_without_optimizer(self, call: str) -> None: ...
    def _end_failed_direct_backward(self) -> None: ...
    def _resume_after_load(self, counters: Optional[dict]) -> None: ...

    # api.py
    def train_batch_size(self) -> int: ...
    def gradient_accumulation_steps(self) -> int: ...
    def zero_optimization_stage(self) -> int: ...
    @property
    def mp_world_size(self) -> int: ...
    @property
    def loss_scale(self) -> float: ...
    def get_lr(self) -> list[float]: ...
    def get_global_grad_norm(self) -> Optional[float]: ...

    # reports.py
    def timing_breakdown(self) -> dict[str, float]: ...

    # accumulation.py
    def managed_gradient_accumulation(self) -> bool: ...
    def _agree_on_window(self, event: str) -> None: ...
    def _agree_on_call(self, call: str) -> None: ...
    def _votes_first(self) -> ContextManager[None]: ...
    def _reduce_local_gradients(self, boundary: bool = True) -> None: ...

    # stepping.py
    def settle(self, *, before_step: bool = False) -> None: ...
