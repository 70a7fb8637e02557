"""Activation checkpointing: keep only a segment's inputs during forward, recompute the
segment in backward.

User code reaches these functions under DeepSpeed's module name, ``zerotrain.checkpointing``
(``checkpointing.py``, which only re-exports them), so a DeepSpeed script moves over
unchanged::

    zerotrain.checkpointing.configure(None, deepspeed_config=args.deepspeed_config)
    x = zerotrain.checkpointing.checkpoint(block, x, mask)

``checkpoint`` is ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` with
DeepSpeed's calling convention and options: the CPU and CUDA RNG states are restored for the
recomputation, so dropout draws the same masks and gradients are bitwise those of the same
code without checkpointing. ``zerotrain.initialize`` calls ``configure`` with the
``activation_checkpointing`` section when the config has one.

Note: checkpointing and stage 3
    Recomputation runs the segment's module forwards again, inside backward. Stage 3's
    forward pre-hook gathers each unit again and its forward hook lets go of it, exactly
    as in forward (``stages/zero3/scheduler.py``); the recomputed values are what backward uses. The
    recomputation is part of the execution order the stage-3 trace records, so from the
    second step on the units are prefetched for it too, and a unit kept gathered after
    its forward passes its hold on to the recomputation. torch normally stops a
    recomputation early, by raising inside the last operation that saves a tensor; the
    stage-3 forward hook still runs then (it is registered with ``always_call``), so
    torch's own checkpoint works as well. ``checkpoint`` turns the early stop off anyway
    and recomputes whole segments, as DeepSpeed does, so that the synchronization and
    timing around a segment (``synchronize_checkpoint_boundary``, ``profile``) close.

Note: options that need model parallelism
    DeepSpeed's ``partition_activations`` splits each checkpointed input into ``mp_size``
    slices over the model-parallel group (``get_partition_size`` is ``numel / mp_size``,
    ``get_partition_start`` is ``numel / mp_size * mp_rank``), keeps this rank's slice, and
    all-gathers the slices before the recomputation. With a model-parallel world of 1 the
    slice is the whole tensor (start 0, size ``numel``), and
    ``gather_partitioned_activations`` skips the all-gather when ``mp_size == 1`` and only
    restores the shape. ``contiguous_memory_optimization`` copies those slices into buffers
    allocated for ``number_checkpoints`` checkpoints: it changes where the bytes live, not
    their values. zerotrain is data parallel only, so its model-parallel world is always 1,
    and both options would keep the same values in the same amount of memory and give the
    same gradients as leaving them off. They are accepted and validated as DeepSpeed does
    (contiguous needs ``partition_activations`` and ``number_checkpoints``) and have nothing
    further to do; an ``mpu`` whose model-parallel world size is above 1 is refused,
    because there they would matter and zerotrain does not split models.

Note: the settings are module state
    DeepSpeed's API configures checkpointing through module-level functions, and the model
    code that calls ``checkpoint`` never sees the engine. The settings are therefore one
    frozen :class:`ActivationCheckpointingConfig`, replaced as a whole by ``configure``; a
    ``checkpoint`` call reads it once.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint

from .config import ActivationCheckpointingConfig, ZeroTrainConfig, load_activation_checkpointing
from .errors import ConfigError

__all__ = ["checkpoint", "configure", "current_settings", "is_configured",
           "non_reentrant_checkpoint", "reset"]

# The name users know (docs/activation_checkpointing.md): DeepSpeed's module name.
logger = logging.getLogger("zerotrain.checkpointing")

_DEFAULTS = ActivationCheckpointingConfig()
_settings: ActivationCheckpointingConfig = _DEFAULTS  # see Note "the settings are module state"
_configured = False

# configure()'s keyword -> the config key it overrides, and the type it must have.
_OVERRIDES = {
    "partition_activations": ("partition_activations", bool),
    "contiguous_checkpointing": ("contiguous_memory_optimization", bool),
    "num_checkpoints": ("number_checkpoints", int),
    "checkpoint_in_cpu": ("cpu_checkpointing", bool),
    "synchronize": ("synchronize_checkpoint_boundary", bool),
    "profile": ("profile", bool),
}


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)``, keep only its inputs, recompute it in backward.

    Called from model code on every rank, as the forward it belongs to: it does not
    communicate itself, but at stage 3 the recomputation gathers parameters through the
    module hooks, so every rank must checkpoint the same segments. Arguments may be
    tensors or anything else; tensor keyword arguments take part in autograd as
    positional ones do. Returns ``function``'s output as DeepSpeed does: a tensor as is, a
    tuple or list as a tuple, except that a one-element one gives its element; any other
    value (a dict, a dataclass) as is. With ``cpu_checkpointing`` the saved inputs are
    kept in host memory (pinned when CUDA is available) and copied back for the
    recomputation, with the same results.
    """
    settings = _settings
    if kwargs:
        function, args = _keywords_as_positional(function, args, kwargs)
    if settings.profile or settings.synchronize_checkpoint_boundary:
        function = _Instrumented(function, settings)
    on_host = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
               if settings.cpu_checkpointing else contextlib.nullcontext())
    # on_host sees exactly the inputs checkpoint saves: the segment's own operations save
    # into checkpoint's inner hooks. No early stop: Note "checkpointing and stage 3". Under
    # torch.compile the segment becomes one recomputed graph region, where early stop does
    # not apply (and the context manager would break the graph).
    early_stop = (contextlib.nullcontext() if torch.compiler.is_compiling()
                  else torch_checkpoint.set_checkpoint_early_stop(False))
    with on_host, early_stop:
        outputs = torch_checkpoint.checkpoint(function, *args, use_reentrant=False)
    return _deepspeed_outputs(outputs)


# DeepSpeed's separate non-reentrant variant; checkpoint is already non-reentrant.
non_reentrant_checkpoint = checkpoint


def configure(mpu_: Any = None, deepspeed_config: Any = None,
              partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None,
              num_checkpoints: Optional[int] = None, checkpoint_in_cpu: Optional[bool] = None,
              synchronize: Optional[bool] = None, profile: Optional[bool] = None) -> None:
    """Set the options of every later ``checkpoint`` call, as DeepSpeed's ``configure``.

    Call it on every rank (it does not communicate). Settings start from the defaults
    (all off), then ``deepspeed_config``'s ``activation_checkpointing`` section (a dict, a
    JSON path or a ``ZeroTrainConfig``; only that section is read and validated here,
    ``initialize`` validates the rest), then each argument that is not None:
    ``partition_activations``, ``contiguous_checkpointing``
    (``contiguous_memory_optimization``), ``num_checkpoints`` (``number_checkpoints``),
    ``checkpoint_in_cpu`` (``cpu_checkpointing``), ``synchronize``
    (``synchronize_checkpoint_boundary``), ``profile``. ``mpu_`` may be None or a
    model-parallel unit whose model-parallel world size is 1 (Note "options that need
    model parallelism"); a larger one raises ConfigError, as does contiguous checkpointing
    without partitioned activations or without a number of checkpoints.
    """
    global _settings, _configured
    if mpu_ is not None:
        _check_model_parallel_world(mpu_)
    section = _section_of(deepspeed_config)
    given = {"partition_activations": partition_activations,
             "contiguous_checkpointing": contiguous_checkpointing,
             "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
             "synchronize": synchronize, "profile": profile}
    updates = {}
    for argument, value in given.items():
        if value is not None:
            key, kind = _OVERRIDES[argument]
            updates[key] = _checked_argument(argument, value, kind)
    settings = section.model_copy(update=updates)
    _check_contiguous(settings)
    _settings, _configured = settings, True
    logger.info("activation checkpointing: partition_activations %s, cpu_checkpointing %s, "
                "contiguous_memory_optimization %s (%s checkpoints), synchronize %s, "
                "profile %s", settings.partition_activations, settings.cpu_checkpointing,
                settings.contiguous_memory_optimization, settings.number_checkpoints,
                settings.synchronize_checkpoint_boundary, settings.profile)


def is_configured() -> bool:
    """True once ``configure`` has been called (``checkpoint`` works either way)."""
    return _configured


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here, for forwards without a
    backward (evaluation). zerotrain keeps no buffers of its own: saved inputs belong to the
    autograd graph and are freed with it. So nothing needs freeing; scripts that call it
    run unchanged, and the settings stay as configured (as in DeepSpeed)."""


def current_settings() -> ActivationCheckpointingConfig:
    """The options ``checkpoint`` uses now."""
    return _settings


# ---------------------------------------------------------------------- helpers
def _section_of(config: Any) -> ActivationCheckpointingConfig:
    if config is None:
        return _DEFAULTS
    if isinstance(config, ActivationCheckpointingConfig):
        return config
    if isinstance(config, ZeroTrainConfig):
        return config.activation_checkpointing
    return load_activation_checkpointing(config)


def _checked_argument(argument: str, value: Any, kind: type) -> Any:
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(argument, f"expected True or False, got {value!r}", value=value)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(argument, f"expected an integer >= 1, got {value!r}", value=value)
    return value


def _check_contiguous(settings: ActivationCheckpointingConfig) -> None:
    """DeepSpeed's own conditions on contiguous checkpointing (its configure asserts them)."""
    if not settings.contiguous_memory_optimization:
        return
    where = "activation_checkpointing.contiguous_memory_optimization"
    if not settings.partition_activations:
        raise ConfigError(where, "needs partition_activations (it copies the partitioned "
                          "activations into contiguous buffers)", value=True,
                          suggestion="set activation_checkpointing.partition_activations "
                                     "to true, or this to false")
    if settings.number_checkpoints is None:
        raise ConfigError(where, "needs number_checkpoints, the number of checkpoints the "
                          "buffers are sized for", value=True,
                          suggestion="set activation_checkpointing.number_checkpoints")


def _check_model_parallel_world(mpu: Any) -> None:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        getter = getattr(mpu, name, None)
        if callable(getter):
            size = int(getter())
            break
    else:
        raise ConfigError("mpu", "expected an object with get_model_parallel_world_size() "
                          f"(or get_tensor_model_parallel_world_size()); got "
                          f"{type(mpu).__name__}")
    if size > 1:
        raise ConfigError("mpu", f"model-parallel world size is {size}; zerotrain is data "
                          "parallel only, so activation checkpointing cannot partition "
                          "activations across a model-parallel group", value=size,
                          suggestion="pass mpu_=None, or an mpu whose model-parallel world "
                                     "size is 1")


def _keywords_as_positional(function: Callable[..., Any], args: tuple,
                            kwargs: dict) -> tuple[Callable[..., Any], tuple]:
    """Pass keyword arguments positionally, so checkpoint saves their tensors as inputs."""
    count, names = len(args), tuple(kwargs)

    def with_keywords(*everything: Any) -> Any:
        return function(*everything[:count], **dict(zip(names, everything[count:])))

    return with_keywords, args + tuple(kwargs.values())


def _deepspeed_outputs(outputs: Any) -> Any:
    """DeepSpeed's return convention: sequences as tuples, a single element unwrapped."""
    if isinstance(outputs, (list, tuple)) and not isinstance(outputs, torch.Tensor):
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
    return outputs


class _Instrumented:
    """Wraps the segment: CUDA synchronization at its boundaries and/or its duration
    logged at DEBUG. The first call is the forward, later ones are recomputations."""

    def __init__(self, function: Callable[..., Any],
                 settings: ActivationCheckpointingConfig) -> None:
        self.function = function
        self.synchronize = torch.cuda.is_available() and (
            settings.synchronize_checkpoint_boundary or settings.profile)
        self.profile = settings.profile
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        phase = "forward" if self.calls == 0 else "recompute"
        self.calls += 1
        if self.synchronize:
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = self.function(*args)
        if self.synchronize:
            torch.cuda.synchronize()
        if self.profile:
            logger.debug("activation checkpoint %s of %s: %.3f ms", phase,
                         getattr(self.function, "__name__", type(self.function).__name__),
                         (time.perf_counter() - start) * 1e3)
        return outputs
