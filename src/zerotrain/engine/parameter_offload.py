"""DeepSpeed's stage-3 ``optimizer.parameter_offload``: the hooks object that generation
loops take apart and put back.

Why: TRL (``trl/models/utils.py``) and DeepSpeed's own ``unwrap_model_for_generation``
gather the whole model once (``GatheredParameters(engine.parameters())``), then remove
stage 3's module hooks through ``optimizer.parameter_offload`` so ``generate()`` runs on
full weights instead of gathering every layer for every token, and after the block call
``_register_deepspeed_module(parameter_offload.module)`` to register them again. zerotrain's
hooks live in its stage (``stages/zero3/hooks.py``); this object shows them under
DeepSpeed's names, with DeepSpeed's semantics:

* ``forward_hooks``: the handles of the module hooks that gather units (``handle.remove()``
  takes one out); reading gives the ones registered now. ``backward_hooks``: always empty,
  since zerotrain starts a unit's backward from its forward hooks (nothing else to remove).
  Both accept assignment, as DeepSpeed's plain lists do (TRL empties them after removing).
* ``_register_deepspeed_module(module)``: every forward hook registered again (none twice)
  and the prefetch trace invalidated, as DeepSpeed does for its root module.
* ``param_coordinator``: ``is_invalid_trace()`` / ``_invalidate_trace()`` on the
  scheduler's recorded order (``stages/zero3/scheduler.py``).
"""
from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from ..errors import StateError


class TraceCoordinator:
    """DeepSpeed's ``PartitionedParameterCoordinator``, as far as its trace goes."""

    def __init__(self, stage: Any) -> None:
        self._stage = weakref.ref(stage)

    def _scheduler(self) -> Any:
        stage = self._stage()
        if stage is None:
            raise StateError("the stage-3 engine this coordinator belonged to is closed")
        return stage.scheduler

    def is_invalid_trace(self) -> bool:
        return not self._scheduler().has_trace

    def _invalidate_trace(self) -> None:
        self._scheduler().forget_trace()


class ParameterOffload:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` of a stage-3 engine (the module Note)."""

    def __init__(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)
        self.param_coordinator = TraceCoordinator(engine.stage)

    def _stage(self) -> Any:
        engine = self._engine()
        if engine is None:
            raise StateError("the engine this parameter_offload belonged to is gone")
        return engine.stage

    @property
    def module(self) -> nn.Module:
        return self._stage().module

    @property
    def forward_hooks(self) -> list[Any]:
        """The handles of the forward hooks registered now (removed ones drop out)."""
        return [h for h in self._stage().forward_hook_handles() if _registered(h)]

    @forward_hooks.setter
    def forward_hooks(self, value: list) -> None:
        """Accepted as DeepSpeed's list is: a hook stays registered until its handle's
        ``remove()``; the list always reads what is registered."""
        list(value)

    @property
    def backward_hooks(self) -> list[Any]:
        return []

    @backward_hooks.setter
    def backward_hooks(self, value: list) -> None:
        list(value)

    def get_param_coordinator(self) -> TraceCoordinator:
        return self.param_coordinator

    def _register_deepspeed_module(self, module: nn.Module, count: Any = None) -> None:
        """Register the stage's forward hooks again on ``module``, the engine's module."""
        stage = self._stage()
        if module is not stage.module:
            raise StateError(
                f"_register_deepspeed_module: {type(module).__name__} is not the engine's "
                f"module ({type(stage.module).__name__}); zerotrain registers stage 3's "
                "hooks on the engine's whole module only")
        stage.reinstall_forward_hooks()

    def empty_partition_cache(self) -> None:
        self._stage().empty_partition_cache()


def _registered(handle: Any) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks
