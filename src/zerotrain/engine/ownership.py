"""Which engine holds a model: each parameter records the stage whose hooks it carries.

Note: one open engine per model
    A training engine's stage keeps hooks on the module's parameters (gradient reduction;
    at stage 3 the gathers too) until ``close()``/``destroy()`` removes them. A second
    engine over the same parameters while the first is open would have its gradients
    taken by the first one's hooks, so each parameter records the stage that hooks it
    (``_zerotrain_stage``, a weak reference) and ``initialize`` closes the engine that
    still holds a model it is given (``open_stage_of``; DeepSpeed lets a second engine take
    the same module), after which the closed engine refuses to train. What the engine
    keeps about the stage (the parameters it claimed, whether it is closed, the engine, its
    parameter watch) is a :class:`StageClaim` in a registry keyed weakly by the stage,
    never attributes written onto the stage (Note "the contract" in stages/protocol.py).
    After ``close()`` the model can be given to a new engine at any stage: below stage 3
    its parameters are whole and current; at stage 3 they stay partitioned, as after
    ``zero.Init``.

Note: a closed engine refuses
    Once closed, an engine's model may belong to a new engine, so whatever the old one does
    (a ``load_checkpoint`` that rewrites the weights, a save of state it no longer owns, an
    accessor reading a released stage) would act on someone else's training. Every public
    method of the engine's classes, and ``nn.Module``'s that change the module, therefore
    starts with one check (:func:`refuse_when_closed`) and raises StateError naming the
    call; ``close()`` and ``destroy()`` stay allowed (a second call does nothing), and so do
    the readers of the engine's own config and of the numbers its last step recorded
    (``train_batch_size()``, ``zero_optimization_stage()``, ``get_global_grad_norm()``...,
    :data:`READS_AFTER_CLOSE`): they touch no model, stage or collective, and a script that
    logs them after its own ``destroy()`` is a valid program.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from ..errors import StateError

from ..stages.base import Stage
from ..stages.param_watch import ParameterWatch


@dataclass(eq=False)
class StageClaim:
    """What the engine records about a stage whose hooks it installed on a model's
    parameters (Note: one open engine per model).

    ``params``: ids of the parameters claimed; ``closed``: the stage was closed (its engine
    refuses, Note: a closed engine refuses); ``engine`` and ``param_watch``: weak
    references to the engine that holds the stage and to its parameter watch (the watch
    reaches the stage through stage 3's ``gather_external``, so a strong one would keep
    the stage, this registry's key, alive for ever)."""

    params: frozenset[int] = frozenset()
    closed: bool = False
    engine: Optional["weakref.ref[Any]"] = None
    param_watch: Optional["weakref.ref[ParameterWatch]"] = None

    def watch(self, param_watch: ParameterWatch) -> None:
        """``param_watch`` is uninstalled when the stage is closed (:func:`close_stage`)."""
        self.param_watch = weakref.ref(param_watch)

    def holder(self) -> Any:
        """The engine that holds the stage, or None when it is gone."""
        return self.engine() if self.engine is not None else None


# stage -> its claim; an entry goes with its stage (the hooks keep it alive while installed)
_CLAIMS: "weakref.WeakKeyDictionary[Stage, StageClaim]" = weakref.WeakKeyDictionary()


# the attribute each claimed parameter carries: a weak reference to the stage hooking it
_STAGE_REF = "_zerotrain_stage"


def claim(stage: Stage, module: nn.Module, *, engine: Any = None) -> StageClaim:
    """Register the claim of ``engine``'s ``stage`` on ``module``'s parameters, and record
    on each parameter the stage whose hooks it carries (a weak reference: the hooks keep
    the stage alive as long as they are installed, even when the engine was dropped
    without ``close()``; a ``deepcopy`` of the module is not claimed)."""
    held = _CLAIMS[stage] = StageClaim(
        frozenset(id(p) for p in module.parameters()),
        engine=weakref.ref(engine) if engine is not None else None)
    ref = weakref.ref(stage)
    for p in module.parameters():
        setattr(p, _STAGE_REF, ref)
    return held


def claim_of(stage: Optional[Stage]) -> Optional[StageClaim]:
    """``stage``'s claim; None for a stage no engine claimed or closed (or None)."""
    return _CLAIMS.get(stage) if stage is not None else None


def is_closed(stage: Optional[Stage]) -> bool:
    """Whether ``stage`` was closed (False for one never claimed nor closed)."""
    held = claim_of(stage)
    return held is not None and held.closed


def close_stage(stage: Stage, module: nn.Module) -> None:
    """Close ``stage`` (offload resources, hooks, the engine's parameter watch) and release
    ``module``'s parameters; also when the engine object itself is gone."""
    stage.close()
    held = _CLAIMS.setdefault(stage, StageClaim())   # an engine that claimed nothing
    watch = held.param_watch() if held.param_watch is not None else None
    if watch is not None:
        watch.uninstall()
    held.closed = True
    for p in module.parameters():
        ref = getattr(p, _STAGE_REF, None)
        if ref is not None and ref() is stage:
            delattr(p, _STAGE_REF)


def open_stage_of(module: nn.Module) -> Optional[tuple[str, Stage]]:
    """The first of ``module``'s parameters (by name) whose hooks belong to an open stage,
    with that stage; None when none is held (Note: one open engine per model)."""
    for name, p in module.named_parameters():
        ref = getattr(p, _STAGE_REF, None)
        stage = ref() if ref is not None else None
        held = claim_of(stage)
        if stage is not None and held is not None and not held.closed and id(p) in held.params:
            return name, stage
    return None


# nn.Module's public methods that change the module (the engine's own are all guarded)
_MODULE_WRITES = ("load_state_dict", "apply", "to", "cuda", "cpu", "half", "float", "double",
                  "bfloat16", "type", "requires_grad_", "share_memory", "register_module",
                  "register_parameter", "register_buffer", "add_module")
# reads of the engine's config and of what its last step recorded (engine/api.py)
READS_AFTER_CLOSE = frozenset((
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "get_batch_info", "zero_optimization", "zero_optimization_stage",
    "zero_optimization_partition_gradients", "zero_optimization_partition_weights",
    "zero_offload_optimizer", "zero_offload_param", "zero_cpu_offload",
    "zero_force_ds_cpu_optimizer", "zero_use_cpu_optimizer", "gradient_clipping",
    "fp16_enabled", "bfloat16_enabled", "dynamic_loss_scale", "steps_per_print",
    "wall_clock_breakdown", "was_step_applied", "get_global_grad_norm"))
_ALWAYS = frozenset(("close", "destroy")) | READS_AFTER_CLOSE


def refuse_when_closed(cls: type) -> type:
    """Guard every public method ``cls`` defines or inherits from zerotrain's classes, and
    nn.Module's that write (Note: a closed engine refuses). A class decorator."""
    names: dict[str, Callable] = {}
    for owner in reversed(cls.__mro__):
        own = owner.__module__.startswith("zerotrain.")
        for name, value in vars(owner).items():
            if name.startswith("_") or name in _ALWAYS or not inspect.isfunction(value):
                continue
            if own or (owner is nn.Module and name in _MODULE_WRITES):
                names[name] = value
            else:
                names.pop(name, None)   # overridden by a class that is not guarded
    for name in names:
        setattr(cls, name, _guarded(name, getattr(cls, name)))
    return cls


def _guarded(name: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if is_closed(self.__dict__.get("stage")):
            raise closed_error(f"{name}()")
        return method(self, *args, **kwargs)
    return guarded


def closed_error(call: str) -> StateError:
    return StateError(f"{call} on a closed engine: destroy() or close() was called, or a "
                      "later initialize() took its model over; train with the engine that "
                      "initialize() returned last")
