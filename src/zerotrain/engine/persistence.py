"""Saving and loading: the engine's checkpoint and full-weight methods.

Why a module of its own: the work is done by ``checkpoint/`` (docs/checkpoints.md), which
sees the engine only as a :class:`~zerotrain.checkpoint.TrainingState`; what is left here is
DeepSpeed's signatures, settling pending updates first, and the background writer of
asynchronous saves. Kept apart, as a mixin :class:`~zerotrain.engine.ZeroEngine` inherits,
it stays out of the engine's training logic.

The mixin reads what the engine sets in ``__init__`` (``module``, ``stage``, ``comm``,
``config``, ``lr_scheduler``, ``loss_scaler``, ``training_dataloader``, ``micro_steps``,
``_moved``, ``_checkpoint_writer``) and calls the engine's ``settle()``,
``inference_only``, ``_resume_after_load()`` and DeepSpeed's accessors.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from .. import checkpoint
from ..checkpoint import full_weights as export
from ..checkpoint import recovery
from ..errors import ConfigError
from ..offload import states as moved_states

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .surface import EngineSurface
else:
    EngineSurface = object   # typing only (surface.py)


class EnginePersistence(EngineSurface):
    """``save_checkpoint``, ``load_checkpoint``, ``wait_for_checkpoint``,
    ``save_16bit_model`` and the consolidated state dict Accelerate and the Trainer ask for."""

    _checkpoint_writer: Optional[checkpoint.BackgroundWriter]   # the async saves' writer

    def _training_state(self) -> checkpoint.TrainingState:
        return checkpoint.TrainingState(
            module=self.module, stage=self.stage, optimizer=self.stage.optimizer,
            comm=self.comm, stage_index=self.zero_optimization_stage(),
            precision=self.config.precision,
            counters={name: getattr(self, name) for name in checkpoint.state.COUNTERS},
            lr_scheduler=self.lr_scheduler, loss_scaler=self.loss_scaler.for_checkpoint(),
            data_loader=self.training_dataloader)

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[dict] = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False,
                        async_save: Optional[bool] = None) -> bool:
        """Write checkpoint ``tag`` (default ``global_step<N>``; other values are named by
        ``str(tag)``, as in DeepSpeed) under ``save_dir``. Collective: every rank calls it.
        ``client_state``: JSON values, tensors, numpy arrays, tuples and
        ``argparse.Namespace`` (docs/checkpoints.md); nothing is pickled.

        Gradients accumulated in an unfinished accumulation window are not saved; save
        after ``step()`` at a boundary for an exact resume.

        ``async_save`` (default: ``checkpoint.writer.decoupled``): return once the state is
        copied into host memory and write it in the background; at most one save is in
        flight, and :meth:`wait_for_checkpoint` waits for it (docs/checkpoints.md).

        ``exclude_frozen_parameters``: leave out the parameters that need no gradient;
        loading keeps them as the model holds them (docs/checkpoints.md).
        """
        if (self.micro_steps % self.gradient_accumulation_steps() != 0
                if self.managed_gradient_accumulation()
                else self.accumulation_window.backward_in_window):
            logger.warning("saving in the middle of gradient accumulation (micro step %d): "
                           "the gradients accumulated so far are not saved", self.micro_steps)
        self._agree_on_call("save_checkpoint")   # every rank saves, or all raise together
        self.settle()
        self.wait_for_checkpoint()
        if async_save is None:
            writer_config = self.config.checkpoint.writer
            async_save = writer_config is not None and writer_config.decoupled
        created = async_save and self._checkpoint_writer is None
        if created:
            self._checkpoint_writer = checkpoint.BackgroundWriter()
        try:
            self.last_checkpoint_report = checkpoint.save_checkpoint(
                self._training_state(), save_dir, tag=None if tag is None else str(tag),
                client_state=client_state, save_latest=save_latest,
                writer=self._checkpoint_writer if async_save else None,
                exclude_frozen_parameters=exclude_frozen_parameters)
        except BaseException:
            if created:   # every rank raised before its writer started: none holds one
                self._checkpoint_writer = None
            raise
        return True

    def _change_recovery_script_permissions(self, dst: str) -> None:
        """Make the recovery script ``dst`` executable, or log at info level why not (a
        file share without permission bits), as DeepSpeed's method of this name does: the
        step every save takes for the ``zero_to_fp32.py`` it leaves in ``save_dir``."""
        recovery.change_permissions(dst)

    def wait_for_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight, if any; raise CheckpointError on every
        rank if it failed (it was then not published). Collective once the engine has made
        an asynchronous save, whether or not one is in flight: every rank calls it."""
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait(self.comm, debug=self.config.debug)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[Optional[str], Optional[dict]]:
        """Load a checkpoint written at any world size and stage; returns ``(path,
        client_state)``, or ``(None, None)`` when ``load_dir`` has none (as DeepSpeed).
        Collective. Loading is always strict: ``load_module_strict=False`` is not
        supported (a warning says so)."""
        if not load_module_strict:
            logger.warning("load_checkpoint(load_module_strict=False) is not supported; "
                           "loading strictly")
        if self.inference_only:   # as in DeepSpeed: no optimizer, so only the weights
            load_optimizer_states = load_lr_scheduler_states = False
        moved_states.refuse_while_away(self._moved, "load_checkpoint()")
        self._agree_on_call("load_checkpoint")   # every rank loads, or all raise together
        self.settle()
        self.wait_for_checkpoint()
        result = checkpoint.load_checkpoint(
            self._training_state(), load_dir, tag=None if tag is None else str(tag),
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only)
        self.last_checkpoint_report = result.report
        if result.path is None:
            return None, None
        self._resume_after_load(result.counters)
        return result.path, result.client_state

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the full model in its training dtype (rank 0 writes; all ranks call).

        At stage 3 this needs ``zero_optimization.stage3_gather_16bit_weights_on_model_save``
        (as in DeepSpeed); without it the call refuses with an error rather than writing an
        empty model.
        """
        zero = self.config.zero_optimization
        if (self.stage.partitions_parameters
                and not zero.stage3_gather_16bit_weights_on_model_save):
            raise ConfigError("zero_optimization.stage3_gather_16bit_weights_on_model_save",
                              "save_16bit_model at stage 3 gathers the full weights; set it "
                              "to true (or use save_checkpoint and `zerotrain consolidate`)")
        self.settle()
        export.save_16bit_model(self.module, self.stage, self.comm, save_dir, save_filename,
                                exclude_frozen_parameters)
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> Optional[dict]:
        """The full state dict on rank 0, None on the others (DeepSpeed's name, called by
        Accelerate's ``get_state_dict`` and the Trainer's ``save_model``; the callers check
        ``zero_gather_16bit_weights_on_model_save`` first). Collective: every rank calls it."""
        self.settle()
        return export.consolidated_state_dict(self.module, self.stage, self.comm.rank,
                                              exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                       ) -> Optional[dict]:
        """DeepSpeed's name for the same when stage 3 or tensor parallelism splits the
        weights (Accelerate's ``get_state_dict`` calls it with ``tensor_parallel``); a
        ValueError otherwise, as DeepSpeed's (the Trainer then saves the plain way).
        Collective: every rank calls it."""
        if not self.stage.partitions_parameters and self.mp_world_size == 1:
            raise ValueError("consolidated_16bit_state_dict is only applicable to cases where "
                             "weights are partitioned, including Zero Stage 3 and tensor "
                             "parallelism.")
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
