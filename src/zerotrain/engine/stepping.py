"""The engine's step: ``engine.step()`` at every micro-step, the update at the boundary,
and the same update for a direct ``optimizer.step()``.

Why a module of its own: the update (reduce what is left, unscale and clip, overflow
check, the stage's step, the fp16 loss scale, the LR scheduler, the step counters) is one
job with its own refusals; kept apart, as a mixin :class:`~zerotrain.engine.ZeroEngine`
inherits, ``engine.py`` keeps the forward and backward. Every change to the accumulation
window goes through ``accumulation_window`` (Note "the window's phases" in window.py).

Note: micro-steps and boundaries
    ``step()`` is called after every micro-step's ``backward()``. The optimizer steps only
    at the accumulation boundary, every ``gradient_accumulation_steps`` micro-steps; in
    between, gradients accumulate. ``global_steps`` counts boundaries, skipped ones included
    (as DeepSpeed counts them); ``skipped_steps`` counts fp16 overflows and non-finite
    gradients. A boundary whose gradient is non-finite under ``"nonfinite": "raise"`` ends
    its window like a skipped step (counted in both, gradients dropped, parameters
    unchanged) before ``NonFiniteGradientError`` propagates, so a loop that catches it and
    goes on starts a fresh window of ``gradient_accumulation_steps`` micro-steps.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from ..errors import (ContextMisuseError, NonFiniteGradientError, StateError,
                      UnusedParameterError)
from ..offload import states as moved_states
from ..stages.base import StepOutcome
from .unused import refuse_unused_parameters

# the engine's logger: what a step reports reads as the engine's
logger = logging.getLogger("zerotrain.engine.engine")

if TYPE_CHECKING:
    from .surface import EngineSurface
else:
    EngineSurface = object   # typing only (surface.py)


class EngineStepping(EngineSurface):
    """``step()``, ``optimizer_step()`` and the update both run (Note: micro-steps and
    boundaries)."""

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """End a micro-step; at the accumulation boundary, update the parameters."""
        self._refuse_without_optimizer("step()")
        moved_states.refuse_while_away(self._moved, "step()")
        self._end_failed_direct_backward()
        window = self.accumulation_window
        if window.coalescing:
            raise ContextMisuseError("engine.step() inside coalesce_grad_reduction() (a no_sync "
                             "block): leave the block first, its exit reduces the gradients")
        window.begin_step()   # the boundary while it runs (Note "unmanaged accumulation")
        if window.updated_by == "optimizer.step()" and not window.backward_in_window:
            window.end_step()
            raise StateError("engine.step() after optimizer.step() with no backward between: "
                             "optimizer.step() already took this window's update; call one "
                             "of engine.step() and optimizer.step() per window, not both")
        with self._timers.time("step"):
            try:
                try:
                    boundary = self.is_gradient_accumulation_boundary()
                    if boundary:
                        self._take_model_step(lr_kwargs or {})
                finally:
                    window.end_step()
            except (NonFiniteGradientError, UnusedParameterError):   # the window is over
                self._end_micro_step(True)
                raise
            self._end_micro_step(boundary)

    def optimizer_step(self) -> None:
        """What a direct ``optimizer.step()`` runs: the engine's update without
        ``engine.step()``, refused where it would train on the wrong gradients (Note
        "optimizer.step() without engine.step()" in optimizer_views.py). Collective."""
        call = "optimizer.step()"
        self._refuse_without_optimizer(call)
        moved_states.refuse_while_away(self._moved, call)
        self._end_failed_direct_backward()   # as engine.step() (direct_backward.py)
        window = self.accumulation_window
        if window.coalescing:
            raise StateError(f"{call} inside coalesce_grad_reduction() (a no_sync block): "
                             "leave the block first, its exit reduces the gradients")
        steps = self.gradient_accumulation_steps()
        if not window.backward_in_window:   # nothing to step: _update names it
            self._update(call)
        # unmanaged accumulation: the call ends the caller's window, _update reduces it
        managed = self.managed_gradient_accumulation()
        if managed and window.boundary_override is None and self.micro_steps % steps:
            raise StateError(
                f"{call} in the middle of an accumulation window that engine.step() is "
                f"counting (micro step {self.micro_steps % steps + 1} of {steps}): the "
                "window would end early; finish it with engine.step(), or use "
                "optimizer.step() without engine.step()")
        if managed and not (self.stage.reduces_every_micro_step
                            or self.is_gradient_accumulation_boundary()):
            raise StateError(
                f"{call} after a backward that does not end the accumulation window "
                f"(gradient_accumulation_steps {steps}): at ZeRO stage "
                f"{self.zero_optimization_stage()} gradients are reduced over ranks only "
                "at its end, so the update would use this rank's alone; call "
                "engine.step() after each backward, or "
                "engine.set_gradient_accumulation_boundary(True) before the last one")
        outcome = self._update(call)
        if not outcome.applied:
            error = self._skip(outcome)
            if error is not None:
                raise error

    def _end_micro_step(self, boundary: bool) -> None:
        if not self.tput_timer.started:   # the module was called without engine.forward
            self.tput_timer.start()
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1
        self.accumulation_window.end_micro_step()
        self.stage.begin_backward(self.is_gradient_accumulation_boundary())

    def _take_model_step(self, lr_kwargs: dict) -> None:
        samples = self._samples_in_window()
        outcome = self._update("engine.step()")
        if outcome.applied:
            if self.lr_scheduler is not None:
                if self.stage.delays_update:  # the update still reads the current lr
                    self.accumulation_window.set_lr_step_due(lr_kwargs)
                else:
                    self._lr_watch.step(self.lr_scheduler, **lr_kwargs)
        error = None if outcome.applied else self._skip(outcome)
        self.global_steps += 1
        self.global_samples += samples
        if self.global_rank == 0 and self.global_steps % self.config.steps_per_print == 0:
            self._log_progress()
        if error is not None:
            raise error

    def _update(self, call: str) -> StepOutcome:
        """The optimizer's part of a step, as DeepSpeed's ZeRO optimizer's ``step()`` does
        it: reduce what is left, unscale and clip, check overflow, update, clear the
        gradients, adjust the fp16 loss scale. ``engine.step()`` at a boundary and a
        direct ``optimizer.step()`` (engine/optimizer_views.py) both run it."""
        window = self.accumulation_window
        self._agree_on_window("update")   # before what one rank alone may refuse
        with self._votes_first():   # this rank's refusals read the vote first
            if not window.backward_in_window:
                taken = (f"; {window.updated_by} already took this window's update: call one "
                         "of engine.step() and optimizer.step() per window, not both"
                         if window.updated_by not in (None, call) else "")
                raise StateError(f"{call} reached an accumulation boundary without any "
                                 "engine.backward(loss) or loss.backward() since the last "
                                 f"update{taken}")
            if not (self.managed_gradient_accumulation() or window.inside_no_sync):
                self._reduce_window()   # the caller's step ends the window (its Note)
            if window.inside_no_sync or window.local_backwards:
                where = ("inside engine.no_sync()" if window.inside_no_sync else
                         f"after {window.local_backwards} backward(s) inside engine.no_sync() "
                         "and none outside it")
                raise StateError(f"{call} at an accumulation boundary {where}: this "
                                 "window's gradients were not reduced over ranks, so the "
                                 "update would use this rank's alone; run the window's last "
                                 "backward outside no_sync, then step")
        self.settle(before_step=True)
        unused = (None if self.config.zero_optimization.ignore_unused_parameters
                  else self.stage.unused_parameters())   # None: the stage does not track them
        if unused is not None:
            try:
                refuse_unused_parameters(unused, self.comm, self.global_steps + 1)
            except UnusedParameterError:
                self.stage.zero_grad()
                window.drop_window(call)
                raise
        window.expect("took_update", call)   # before the update (Note in window.py)
        outcome = self.stage.step(grad_scale=self.loss_scaler.loss_scale,
                                  clip=self.config.gradient_clipping)
        window.took_update(call, outcome)
        self.loss_scaler.update(overflow=not outcome.applied)
        return outcome

    def settle(self, *, before_step: bool = False) -> None:
        """With ``offload_optimizer.dpu``, wait for the update running on the host, publish
        it to the module and advance the LR scheduler; a no-op otherwise. Collective:
        checkpoints, ``save_16bit_model`` and ``eval()`` call it, so they see the newest
        parameters (and, with ``offload_optimizer.speculative``, no host step taken ahead
        of ``step()``)."""
        self.stage.settle(before_step=before_step)
        if self.accumulation_window.lr_step_due is not None:
            due = self.accumulation_window.take_lr_step_due()
            self._lr_watch.step(self.lr_scheduler, **(due or {}))

    def _skip(self, outcome: StepOutcome) -> Optional[NonFiniteGradientError]:
        """A non-finite gradient, counted as skipped: fp16 rescales; otherwise the
        ``nonfinite`` policy decides (the error to raise once the step is counted)."""
        order = {name: i for i, (name, _) in enumerate(self.module.named_parameters())}
        names = sorted(outcome.nonfinite_params, key=lambda n: order.get(n, len(order)))
        first = repr(names[0]) if names else "an unknown parameter"
        where = (f"step {self.global_steps + 1}: the gradient norm is {outcome.grad_norm}; "
                 f"first non-finite gradient (in model order) in {first}"
                 + (f" and {len(names) - 1} more" if len(names) > 1 else ""))
        self.skipped_steps += 1
        if self.loss_scaler.skips_overflows:
            logger.warning("fp16 overflow at %s: step skipped, loss scale now %s", where,
                           self.loss_scale)
            return None
        if self.config.nonfinite == "raise":
            return NonFiniteGradientError(
                f"{where} ({self.config.precision} training; parameters left unchanged; set "
                "\"nonfinite\": \"skip\" to skip such steps instead)")
        logger.warning("skipped %s", where)
        return None

    def _log_progress(self) -> None:
        rate = self.tput_timer.avg_samples_per_sec()
        logger.info("step=%d skipped=%d lr=%s loss_scale=%s grad_norm=%s samples/s=%s",
                    self.global_steps, self.skipped_steps, self.get_lr(), self.loss_scale,
                    self.get_global_grad_norm(), f"{rate:.1f}" if rate > 0 else "-")
        if self.config.wall_clock_breakdown:
            logger.info("time (ms) over the last %d steps: %s", self.config.steps_per_print,
                        {k: round(v * 1e3, 2) for k, v in self.timing_breakdown().items()})

    def _reduce_window(self) -> None:
        """Unmanaged mode, before the update: reduce what the window's backwards left on
        this rank (stages 0-1; stages 2-3 reduced each backward already)."""
        if not self.stage.reduces_every_micro_step:
            self._reduce_local_gradients()

    def _samples_in_window(self) -> int:
        """Samples the ending window trained on: ``train_batch_size``, or in unmanaged mode
        one micro-batch per rank per backward actually run, as DeepSpeed counts them."""
        if self.managed_gradient_accumulation():
            return self.train_batch_size()
        return (self.train_batch_size() // self.gradient_accumulation_steps()
                * self.accumulation_window.window_backwards)
