"""Train a Hugging Face ``Trainer`` script with zerotrain by changing its import.

``ZeroTrainer`` and ``ZeroTrainingArguments`` replace ``Trainer`` and ``TrainingArguments``;
the DeepSpeed config goes in ``deepspeed=`` (as before) or ``zerotrain=``. See
``docs/huggingface.md`` for the user's view and the list of Trainer internals relied on.

Note: who does what
    The Trainer keeps its data loaders (sharded by accelerate), its loop, loss
    computation, gradient-accumulation bookkeeping, callbacks, logging, evaluation and
    checkpoint rotation. The zerotrain engine replaces exactly what DeepSpeed replaces in
    ``Trainer(deepspeed=...)``: the model wrapping (no DDP), the backward, the gradient
    reduction, clipping, the optimizer and scheduler steps, and the optimizer/scheduler
    part of checkpoints. The override points, all small:

    * ``accelerator.backward`` (replaced on this Trainer's accelerator instance): the
      Trainer's ``training_step`` and subclasses that write their own (TRL's do) call it
      once per micro-batch; here it is ``engine.backward(loss, scale_wrt_gas=False)`` then
      ``engine.step()``, as accelerate does for DeepSpeed. The Trainer has already divided
      the loss for accumulation, hence ``scale_wrt_gas=False``.
    * ``accelerator.no_sync`` (replaced the same way) does nothing, as the Trainer does
      under DeepSpeed: the engine reduces at its own accumulation boundary, and
      ``engine.no_sync()`` refuses at stages 2-3.
    * ``_prepare_for_training`` builds the engine instead of ``accelerator.prepare``;
      ``_wrap_model`` hands the engine to the evaluation loop too.
    * ``_clip_grad_norm``/``_get_grad_norm`` report the engine's global norm (it clipped).
    * ``save_model``, ``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``,
      ``_load_best_model``: full weights gathered for ``save_pretrained``; the sharded
      engine checkpoint in each ``checkpoint-N`` folder.

Note: short last window
    When an epoch's batch count is not a multiple of ``gradient_accumulation_steps``, the
    Trainer updates after the remaining micro-batches. The engine counts micro-steps
    itself, so before that last backward it asks the engine to end its window at the same
    micro-batch (``engine.end_window_at_next_backward()``). (The Trainer has already scaled
    those losses for the shorter window.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Optional

try:
    import accelerate  # noqa: F401  (the Trainer needs it; fail here with the fix)
    import torch
    from transformers import Trainer, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised only without the extras
    raise ImportError(f"zerotrain.integrations.transformers needs transformers and accelerate "
                      f"({exc.name} is missing): pip install zerotrain[transformers]") from exc

from ..config import read_config_dict
from ..errors import ConfigError
from ..engine.build import initialize, release_model
from ..schedules import build_scheduler
from ..stages.factory import partitions_parameters
from . import hf_config
from .hf_views import EngineOptimizerView, EngineSchedulerView
from .hf_weights import (from_pretrained, gathered_state_dict, is_saved_checkpoint,
                         zero3_init)

__all__ = ["ZeroTrainer", "ZeroTrainingArguments", "from_pretrained", "gathered_state_dict",
           "zero3_init"]

# The Trainer internals overridden below (module Note); their absence means a transformers
# older than the one this was written against (5.23), whose loop would wrap the model in DDP.
_TRAINER_HOOKS = ("_prepare_for_training", "_wrap_model", "_clip_grad_norm", "_get_grad_norm",
                  "_save_optimizer_and_scheduler", "_load_from_checkpoint", "_load_best_model")
if not all(callable(getattr(Trainer, name, None)) for name in _TRAINER_HOOKS):
    raise ImportError("zerotrain.integrations.transformers was written against transformers "
                      "5.23, whose Trainer has the methods it overrides; this one lacks "
                      f"{[n for n in _TRAINER_HOOKS if not hasattr(Trainer, n)]}: "
                      "pip install -U 'transformers>=5.23'")

logger = logging.getLogger(__name__)
_OWNED_BY_ZERO_TRAINER = "_zerotrain_trainer_init"   # set while ZeroTrainer.__init__ runs


@dataclasses.dataclass
class ZeroTrainingArguments(TrainingArguments):
    """``TrainingArguments`` whose DeepSpeed config is run by zerotrain.

    ``deepspeed=`` (a dict, a JSON string or a path) is taken over as the zerotrain config,
    so an existing script only changes its import; ``zerotrain=`` is the same thing under
    zerotrain's name (give one of them). With neither, zerotrain runs stage 0 with every
    setting taken from the arguments. On a machine without CUDA ``use_cpu`` is turned on,
    which the plain Trainer needs under torchrun to train as one data-parallel job.
    """

    zerotrain: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "zerotrain (DeepSpeed-format) config: a dict, a JSON "
                                        "string or the path of a JSON file"})

    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "zerotrain"]

    def __post_init__(self) -> None:
        if self.deepspeed is not None:
            if self.zerotrain is not None:
                raise ValueError("ZeroTrainingArguments: give the config once, as zerotrain= "
                                 "or as deepspeed=, not both")
            # Taken over before TrainingArguments sees it: it would enable accelerate's
            # DeepSpeed plugin, which needs DeepSpeed installed.
            self.zerotrain, self.deepspeed = self.deepspeed, None
        if not self.use_cpu and not torch.cuda.is_available():
            self.use_cpu = True
        super().__post_init__()

    @property
    def place_model_on_device(self) -> bool:
        """The engine places (and at stage 3 partitions) the model, not the Trainer.

        ``Trainer.__init__`` reads this; only ``ZeroTrainer`` may (the plain Trainer would
        train these arguments as plain data parallelism, without ZeRO and without a word).
        """
        if not self.__dict__.get(_OWNED_BY_ZERO_TRAINER, False):
            raise TypeError("ZeroTrainingArguments were given to a Trainer that is not "
                            "ZeroTrainer; it would train without zerotrain (plain data "
                            "parallelism, no ZeRO). Use zerotrain.integrations.transformers"
                            ".ZeroTrainer (same arguments), or plain TrainingArguments")
        return False

    @property
    def n_gpu(self) -> int:
        """At most 1: zerotrain is one process per device, never ``nn.DataParallel``, so
        the batch and loss arithmetic must not multiply by the visible GPUs."""
        return min(1, super().n_gpu)


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` with the zerotrain engine doing backward, reduction and the
    optimizer step (module Notes). Same constructor; ``args`` must be ZeroTrainingArguments.

    ``trainer.engine`` is the engine once training or evaluation has started (also as
    ``trainer.deepspeed`` and ``trainer.model_wrapped``, where DeepSpeed scripts look).
    """

    def __init__(self, model: Any = None, args: Optional[ZeroTrainingArguments] = None,
                 *rest: Any, **kwargs: Any) -> None:
        if args is None:
            args = ZeroTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, ZeroTrainingArguments):
            raise TypeError("ZeroTrainer needs ZeroTrainingArguments (same fields as "
                            f"TrainingArguments, plus zerotrain=); got {type(args).__name__}")
        object.__setattr__(args, _OWNED_BY_ZERO_TRAINER, True)   # place_model_on_device
        try:
            super().__init__(model, args, *rest, **kwargs)
        finally:
            object.__setattr__(args, _OWNED_BY_ZERO_TRAINER, False)
        self.engine: Any = None
        self._client_optimizer, self._client_scheduler = self.optimizer, self.lr_scheduler
        self._scheduler_view: Optional[EngineSchedulerView] = None
        self.accelerator.backward = self._engine_backward  # Note: who does what
        self.accelerator.no_sync = lambda model=None: contextlib.nullcontext()
        self.zerotrain_config()  # disagreements with the arguments fail here, on every rank

    # ------------------------------------------------------------------ config
    def zerotrain_config(self, num_training_steps: Optional[int] = None) -> dict:
        """The config with its "auto" values filled from the arguments and the model (and
        the scheduler's step counts when ``num_training_steps`` is given)."""
        config = hf_config.fill_from_args(read_config_dict(self.args.zerotrain), self.args,
                                          world_size=self.args.world_size)
        config = hf_config.fill_from_model(config, self.model)
        if num_training_steps is not None:
            config = hf_config.fill_schedule(config, self.args, num_training_steps)
        return config

    # ------------------------------------------------------------------ engine
    def _ensure_engine(self) -> Any:
        """Build the engine once per model (collective). Without an ``optimizer`` section the
        optimizer is the Trainer's own (``create_optimizer``: ``args.optim``, decay groups),
        re-targeted at the shards, as transformers does for DeepSpeed."""
        if self.engine is not None and self.engine.module is self.model:
            return self.engine
        config = self.zerotrain_config()
        config.pop("scheduler", None)  # built in _attach_scheduler, once steps are known
        _refuse_autos(config)
        if "optimizer" in config:
            if self._client_optimizer is not None:
                raise ConfigError("optimizer", "given both in the zerotrain config and as "
                                  "Trainer(optimizers=...); remove one")
            optimizer = None
            params = [p for p in self.model.parameters() if p.requires_grad]
        else:
            self.optimizer = self._client_optimizer
            optimizer, params = self.create_optimizer(), None
            # the Trainer's own optimizer is meant, offloaded or not (unless the config says)
            config.setdefault("zero_force_ds_cpu_optimizer", False)
        if release_model(self.model):   # a Trainer before this one trained the same model
            logger.info("closed the zerotrain engine of an earlier Trainer on this model")
        engine, *_ = initialize(model=self.model, optimizer=optimizer,
                                model_parameters=params, config=config)
        self.engine = self.deepspeed = self.model_wrapped = engine
        self.optimizer = EngineOptimizerView(engine)
        return engine

    def _attach_scheduler(self, num_training_steps: int) -> None:
        """Give the engine its scheduler: the config's section (DeepSpeed's formulas), the
        Trainer's ``optimizers=`` one, or the one ``args.lr_scheduler_type`` names."""
        inner = self.engine.optimizer.optimizer
        section = self.zerotrain_config(num_training_steps).get("scheduler")
        if section is not None:
            if self._client_scheduler is not None:
                raise ConfigError("scheduler", "given both in the zerotrain config and as "
                                  "Trainer(optimizers=...); remove one")
            _refuse_autos(section, "scheduler")
            scheduler = build_scheduler(section.get("type"), section.get("params"), inner)
        elif self._client_scheduler is not None:
            scheduler = self._client_scheduler
        else:
            self.lr_scheduler = None
            scheduler = super().create_scheduler(num_training_steps, optimizer=inner)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError("lr_scheduler_type", "metric-driven schedules (reduce on "
                              "plateau) are not supported by ZeroTrainer")
        self.engine.lr_scheduler = scheduler
        self.lr_scheduler = self._scheduler_view = EngineSchedulerView(scheduler)

    def _engine_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``accelerator.backward`` for this Trainer: one micro-step of the engine."""
        engine = self._ensure_engine()
        if self.accelerator.sync_gradients:
            engine.end_window_at_next_backward()   # Note: short last window
        engine.backward(loss, retain_graph=bool(kwargs.get("retain_graph", False)),
                        scale_wrt_gas=False)
        if engine.is_gradient_accumulation_boundary() and self._scheduler_view is not None:
            self._scheduler_view.note_update(engine.get_lr())
        engine.step()

    # ------------------------------------------------------------------ Trainer hooks
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any,
                              resume_from_checkpoint: Optional[str]) -> tuple[Any, Any]:
        engine = self._ensure_engine()
        self._attach_scheduler(max_steps)
        if resume_from_checkpoint is not None:
            path, _ = engine.load_checkpoint(resume_from_checkpoint)
            if path is None:
                raise ValueError(f"no zerotrain checkpoint in {resume_from_checkpoint}")
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        """The engine stands in for DDP/accelerate wrapping, in training and evaluation,
        so evaluation runs through the engine's module (gathering at stage 3)."""
        return self._ensure_engine()

    def _clip_grad_norm(self, model: Any) -> Optional[float]:
        return self.engine.get_global_grad_norm()  # the engine clipped at the boundary

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Optional[float]:
        return self.engine.get_global_grad_norm()

    # ------------------------------------------------------------------ saving
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Write a Hugging Face folder (``save_pretrained``: safetensors + config.json) that
        loads without zerotrain. Collective: every rank must call it (at stage 3 the full
        weights are gathered, one parameter at a time, onto rank 0's CPU).

        In ``checkpoint-N`` folders at stage 3 the weights are gathered only when
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` is true, as with
        DeepSpeed; the sharded engine checkpoint beside them holds them anyway.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        config = read_config_dict(self.args.zerotrain)
        if not partitions_parameters(hf_config.zero_stage(config)):
            super().save_model(output_dir, _internal_call)
            return
        zero = config.get("zero_optimization", {})
        gather = not _internal_call or any(
            zero.get(k) for k in ("stage3_gather_16bit_weights_on_model_save",
                                  "gather_16bit_weights_on_model_save",
                                  "stage3_gather_fp16_weights_on_model_save"))
        if gather:
            self._save(output_dir, state_dict=gathered_state_dict(self.model))
        elif self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.model.config.save_pretrained(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's sharded checkpoint (every rank writes its shards) in ``output_dir``:
        master weights, optimizer and scheduler state, counters."""
        self._ensure_engine().save_checkpoint(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing to load yet: the weights come with the engine checkpoint, which
        ``_prepare_for_training`` loads once the engine exists."""
        if not is_saved_checkpoint(resume_from_checkpoint):
            raise ValueError(f"{resume_from_checkpoint} holds no zerotrain checkpoint (no "
                             "'latest' file); was it written by ZeroTrainer?")

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        logger.info("loading the best model from %s (score %s)", best, self.state.best_metric)
        self._ensure_engine().load_checkpoint(best, load_module_only=True)


def _refuse_autos(config: dict, path: str = "") -> None:
    left = [f"{path}.{k}" if path else k for k in hf_config.remaining_autos(config)]
    if left:
        raise ConfigError(left[0], '"auto" cannot be filled from the Trainer for this key; '
                          "give a value", value="auto")

