"""The training engine: DeepSpeed's engine API over a ZeRO stage.

The engine orchestrates and owns no math: gradients, shards and the update belong to the
stage (``stages/``), loss scaling to ``precision.py``, collectives to ``comm``.

The step and the update: ``stepping.py`` (Note "micro-steps and boundaries" there); the
accumulation window's state and phases: ``window.py``. When a backward keeps its gradients
on this rank: Note "no_sync" in ``accumulation.py``; when the caller's ``step()`` ends every
window instead (``managed_gradient_accumulation: false``): Note "unmanaged accumulation"
there.

One open engine per model: Note in ``ownership.py``.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
from torch import nn

from .. import checkpoint
from . import autocast
from ..comm import Communicator
from ..comm.agreement import from_a_vote
from .compile import Compilation, EngineCompile
from ..config import ZeroTrainConfig
from .direct_backward import DirectBackward
from .accumulation import EngineAccumulation
from .vote_plan import vote_plan_for
from .window import AccumulationWindow
from .api import DeepSpeedEngineAPI
from .persistence import EnginePersistence
from .stepping import EngineStepping
from .reports import EngineReports, reach_totals
from ..errors import LossValueError, StateError
from .lr_watch import SchedulerWatch
from ..offload import states as moved_states
from ..optim import InferenceOnlyOptimizer, ZeroOptimizer
from .ownership import claim, close_stage, is_closed, refuse_when_closed
from ..core.precision import LossScaling, PrecisionPolicy, loss_scaling
from ..stages.base import Stage
from ..stages.param_watch import ParameterWatch
from ..stages.factory import deepspeed_kinds, shards_optimizer
from .throughput import ThroughputTimer
from .timers import StepTimers
from .group_gradients import gradient_norms_by_group

logger = logging.getLogger(__name__)


@refuse_when_closed   # Note "a closed engine refuses" in ownership.py
class ZeroEngine(DeepSpeedEngineAPI, EngineReports, EnginePersistence, EngineCompile,
                 EngineStepping, EngineAccumulation, nn.Module):
    """Wraps the user's module; ``engine(batch)``, ``backward(loss)``, ``step()``. DeepSpeed's
    one-line configuration accessors come from :class:`DeepSpeedEngineAPI`."""

    def __init__(self, module: nn.Module, *, config: ZeroTrainConfig, comm: Communicator,
                 stage: Stage, policy: PrecisionPolicy, lr_scheduler: Any = None,
                 training_dataloader: Any = None) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.comm = comm
        self.stage = stage
        self.policy = policy
        self.optimizer = ZeroOptimizer(stage.optimizer, deepspeed_kinds(config),
                                       lambda: gradient_norms_by_group(self),
                                       lambda: self.get_global_grad_norm())
        self.lr_scheduler = lr_scheduler
        self._lr_watch = SchedulerWatch()   # warns if the user's loop steps it too
        self._checkpoint_writer: Optional[checkpoint.BackgroundWriter] = None  # async saves
        self.training_dataloader = training_dataloader
        self.loss_scaler: LossScaling = loss_scaling(config.fp16)   # fp16, or no scaling
        self.global_rank = comm.rank
        self.world_size = comm.world_size
        self.local_rank = _local_rank()
        self.device = next(module.parameters()).device
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._direct = DirectBackward(self._backward_prologue, self._backward_epilogue,
                                      _direct_backward_refusal(config))
        # Note "the window's phases" in window.py: its transitions are its only writer
        self.accumulation_window = AccumulationWindow(backward_raised=self._direct.raised)
        self._timers = StepTimers(self.device)   # Note: timing on a GPU (timers.py)
        self.tput_timer = ThroughputTimer(config.train_batch_size, self.device)
        self._comm_mark = (self.global_steps, reach_totals(comm.ledger))
        self._peaks: dict[str, int] = {}   # memory_breakdown's measured and predicted peaks
        self.copy_ledger = stage.copy_ledger      # host <-> device copies, by direction
        self.host_traffic = stage.host_traffic    # host memory bytes, by phase of the step
        self._compilation: Optional[Compilation] = None
        self._moved = moved_states.StateMover(self.device)   # offload_states / reload_states
        self._auto_cast = ((config.fp16.enabled and config.fp16.auto_cast)
                           or (config.bf16.enabled and config.bf16.auto_cast))
        self._autocast_dtype = autocast.autocast_dtype(config, self.device)   # torch_autocast
        self._param_watch: Optional[ParameterWatch] = None
        if not self.inference_only or stage.partitions_parameters:
            held = claim(stage, module, engine=self)   # Note: one open engine per model
            # Note "parameters the engine does not hold" in stages/param_watch.py
            self._param_watch = ParameterWatch(module, held.params,
                                               gather_external=stage.gather_external)
            self._param_watch.install()
            held.watch(self._param_watch)   # removed by close_stage
        if not self.inference_only:   # Note "vote plans" in vote_plan.py
            self._vote_plan = vote_plan_for(self)
        self.stage.begin_backward(self.is_gradient_accumulation_boundary())

    # ------------------------------------------------------------------ training
    def forward(self, *args, **kwargs):
        """Run the module; floating inputs are cast to the parameter dtype only when
        ``fp16.auto_cast`` (DeepSpeed's) or ``bf16.auto_cast`` (zerotrain's opt-in) is set,
        and otherwise reach the module as given, as in DeepSpeed."""
        moved_states.refuse_while_away(self._moved, "forward()", parameters_only=True)
        self._end_failed_direct_backward()
        with self._timers.time("forward"):
            if self._auto_cast:
                args, kwargs = self.policy.cast_inputs(args), self.policy.cast_inputs(kwargs)
            trail, noted = self.comm.ledger.trail, 0
            if torch.is_grad_enabled():   # Note "step fingerprint" in comm/trail.py
                trail.note("forward", None, "engine forward")
                noted = trail.count
            self.tput_timer.start()
            try:
                with autocast.forward_context(self._autocast_dtype, self.device):
                    outputs = self.module(*args, **kwargs)
            except BaseException:   # Note "a forward that raises" in comm/trail.py
                if noted:
                    trail.withdraw(noted)
                raise
        if torch.is_grad_enabled() and not self.inference_only:
            outputs = self._direct.gate(outputs)   # loss.backward() works too (its Note)
        return outputs

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of one micro-step: divides by the accumulation steps, scales for fp16,
        and leaves the gradient reduced (or accumulated) in the stage's buffers."""
        self._refuse_without_optimizer("backward()")
        self._end_failed_direct_backward()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise StateError(f"backward() needs a scalar loss tensor, got "
                             f"{type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))}")
        if not loss.requires_grad:
            raise StateError("backward() got a loss that does not require grad; was it "
                             "computed under torch.no_grad() or from a detached tensor?")
        with self._timers.time("backward"):
            scaled = loss
            if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
                scaled = scaled / self.gradient_accumulation_steps()
            scaled = self.loss_scaler.scale(scaled)
            self._backward_prologue("engine.backward()")
            try:
                with self._direct.managed():
                    scaled.backward(retain_graph=retain_graph)
            except BaseException as exc:   # Note "a failed backward" in comm/trail.py
                self.accumulation_window.fail_backward()
                if not isinstance(exc, Exception) or from_a_vote(exc):
                    # an interrupt, or every rank stopped at the vote: launch nothing more
                    self.accumulation_window.abandon_backward()
                    raise
                self.comm.read_deferred()   # a vote's verdict before this rank's own error
                self.comm.ledger.trail.note("backward failed", None, type(exc).__name__)
                self._backward_epilogue()   # ended as a backward (its gaps as zeros)
                raise
            self._backward_epilogue()
        return loss

    def _end_failed_direct_backward(self) -> None:
        """A direct ``loss.backward()`` that raised: end it now as ``backward`` ends a failed
        one (Note "a direct backward that raises" in direct_backward.py)."""
        if not self._direct.take_unfinished():
            return
        self.accumulation_window.fail_backward("loss.backward()")
        if self.comm.stopped_by_vote is not None:
            self.accumulation_window.abandon_backward()
            return
        self.comm.read_deferred()   # a vote's verdict before this rank's own failure
        self.comm.ledger.trail.note("backward failed", None, "loss.backward()")
        self._backward_epilogue()   # ended as a backward (its gaps as zeros)

    def _backward_prologue(self, call: str = "loss.backward()") -> float:
        """Before a backward's gradients exist: tell the stage whether it ends the window.
        Returns what a direct ``loss.backward()`` multiplies its output gradients by (the
        accumulation scaling; the loss scale is ``engine.scale``'s, as in DeepSpeed)."""
        moved_states.refuse_while_away(self._moved, "backward()")
        if not self.stage.partitions_parameters:   # stage 3 notes each unit backward uses
            self.comm.ledger.trail.note("backward", None, "engine backward")   # comm/trail.py
        window = self.accumulation_window
        if window.drop_grads_at_backward:   # optimizer.zero_grad() since the last backward
            self.zero_grad()
        self._agree_on_window("backward")   # before it reduces (Notes in accumulation.py)
        with self._votes_first():   # a refused second backward: the vote's verdict first
            self.stage.begin_backward(self.is_gradient_accumulation_boundary(),
                                      local=window.inside_no_sync)
        window.begin_backward(call)
        return 1.0 / self.gradient_accumulation_steps()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (unchanged in bf16/fp32): what to call
        ``.backward()`` on instead of ``engine.backward(loss)``, as in DeepSpeed. A loss
        that is not one number is refused (its backward would need a gradient argument
        the scale would not reach)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                    else type(loss).__name__)
            raise LossValueError(f"engine.scale(loss) takes a scalar tensor (the loss), got "
                                 f"{what}")
        return self.loss_scaler.scale(loss)

    def _backward_epilogue(self) -> None:
        """After every gradient of the backward has arrived."""
        window = self.accumulation_window
        try:
            self.stage.finish_backward()
        except BaseException:   # a vote's verdict read at its last launch: nothing counted
            window.fail_backward()
            window.abandon_backward()
            raise
        window.end_backward(boundary=self.is_gradient_accumulation_boundary())

    @property
    def inference_only(self) -> bool:
        """Built without an optimizer (no ``optimizer`` section, no ``initialize(optimizer=)``):
        forward, evaluation, generation and checkpoint loading only, as in DeepSpeed."""
        return isinstance(self.stage.optimizer, InferenceOnlyOptimizer)

    def _refuse_without_optimizer(self, call: str) -> None:
        if self.inference_only:
            raise StateError(f"{call} needs an optimizer: this engine was built without one "
                             "(no 'optimizer' section in the config and no "
                             "initialize(optimizer=...)), so it runs forward only")

    def train(self, mode: bool = True) -> "ZeroEngine":
        if not mode and "stage" in self.__dict__:
            self.settle()
        return super().train(mode)

    def close(self) -> None:
        """Finish pending work, release offload threads and NVMe swap files, and remove the
        stage's hooks from the module, which a new engine may then take (Note: one open
        engine per model). An asynchronous save in flight is waited for first (collective,
        as :meth:`wait_for_checkpoint`); if it failed, the engine is closed all the same and
        the CheckpointError naming its tag is raised. Calling it again does nothing."""
        if is_closed(self.stage):
            return
        self.settle()
        try:
            self.wait_for_checkpoint()
        finally:
            self._checkpoint_writer = None      # its staging buffer goes with it
            if self._vote_plan is not None:
                self._vote_plan.close()
            close_stage(self.stage, self.module)   # the parameter watch too

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (the engine does this after every update). The
        gradients live in the stage's buffers, not in the parameters' ``.grad``, so
        ``set_to_none`` (``nn.Module.zero_grad``'s) changes nothing: they are dropped."""
        self.stage.zero_grad()
        self.accumulation_window.zero_grad()

    def _resume_after_load(self, counters: Optional[dict]) -> None:
        """After a checkpoint load: its counters, and a fresh accumulation window."""
        if counters is not None:
            for name, value in counters.items():
                setattr(self, name, value)
        self.stage.zero_grad()
        self.accumulation_window.reset_after_load()
        self._lr_watch.rebase(self.lr_scheduler)
        self.stage.begin_backward(self.is_gradient_accumulation_boundary())

    # ------------------------------------------------------------------ accessors
    def is_gradient_accumulation_boundary(self) -> bool:
        override = self.accumulation_window.boundary_override
        if override is not None:
            return override
        if not self.managed_gradient_accumulation():   # the caller's step() is the boundary
            return self.accumulation_window.in_step
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual override, as accelerate uses it: from now on the caller says,
        before each backward, whether it ends the accumulation window (``step()`` updates
        only then), instead of the engine counting micro-steps. The loss is still divided by
        ``gradient_accumulation_steps``."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary() takes a bool, got "
                            f"{type(is_boundary).__name__}")
        self._refuse_unmanaged("set_gradient_accumulation_boundary()")
        self.accumulation_window.set_boundary_override(is_boundary)   # the next backward

    def end_window_at_next_backward(self) -> None:
        """Count micro-steps forward so that the next backward ends the accumulation window
        (a Hugging Face Trainer's short last window: Note "short last window" in
        integrations/transformers.py). Nothing happens where it ends there already."""
        if not self.is_gradient_accumulation_boundary():
            window = self.gradient_accumulation_steps()
            self.micro_steps += window - 1 - self.micro_steps % window

    @property
    def _is_gradient_accumulation_boundary(self) -> Optional[bool]:
        """The override ``set_gradient_accumulation_boundary`` set (None: the engine counts
        micro-steps), under DeepSpeed's attribute name, which code saving and restoring
        the caller's choice reads."""
        return self.accumulation_window.boundary_override

    @property
    def inside_no_sync_ctxt(self) -> bool:
        """Inside ``no_sync()`` or ``coalesce_grad_reduction()`` (DeepSpeed's attribute name;
        Note "no_sync" in accumulation.py)."""
        return self.accumulation_window.inside_no_sync

    def __getattr__(self, name: str):
        """Unknown attributes come from the wrapped module, as with DeepSpeed's engine."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)

    def offload_states(self, include: Optional[Any] = None, device: Any = "cpu",
                       pin_memory: bool = True, non_blocking: bool = False) -> None:
        """DeepSpeed's ``offload_states``: move the named training states (all by default:
        ``OffloadStateTypeEnum``) to the host to free accelerator memory, values kept
        (Note in offload/states.py); ``reload_states()`` brings them back. States already
        on the host (offloaded by the config, or a CPU run) stay where they are."""
        kinds = moved_states.requested_kinds(
            include, device, param_offloaded=self.config.zero_optimization.offload_param
            is not None and self.config.zero_optimization.offload_param.device != "none",
            inference_only=self.inference_only)
        if kinds is None:
            logger.warning("offload_states(device='none'): nothing to move")
            return
        self.settle()
        self.empty_partition_cache()
        self._moved.offload(self.stage.movable_states(), self.stage.state_views(), kinds,
                            pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's ``reload_states``: every state ``offload_states`` moved back on the
        device."""
        self._moved.reload(non_blocking=non_blocking)


def _direct_backward_refusal(config: ZeroTrainConfig) -> Optional[str]:
    """Why a plain ``loss.backward()`` is refused with this config, or None: at stage 0, as
    DeepSpeed refuses it there (Note "stage 0" in ``direct_backward.py``)."""
    if shards_optimizer(config.zero_optimization.stage):
        return None
    return ("Direct calls to tensor.backward() are not supported at ZeRO stage 0 (as in "
            "DeepSpeed): call engine.backward(loss) instead, or use stage 1-3, where "
            "loss.backward() then engine.step() works")


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))
