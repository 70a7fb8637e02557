"""Which engine holds a model: each parameter records the stage whose hooks it carries.

Note: one open engine per model
    A training engine's stage keeps hooks on the module's parameters (gradient reduction;
    at stage 3 the gathers too) until ``close()``/``destroy()`` removes them. A second
    engine over the same parameters while the first is open would have its gradients
    taken by the first one's hooks, so each parameter records the stage that hooks it
    (``_zerotrain_stage``, a weak reference) and ``initialize`` closes the engine that
    still holds a model it is given (``open_stage_of``; DeepSpeed lets a second engine take
    the same module), after which the closed engine refuses to train. After ``close()`` the
    model can be given to a new engine at any stage: below stage 3 its parameters are whole
    and current; at stage 3 they stay partitioned, as after ``zero.Init``.
"""
from __future__ import annotations

import weakref
from typing import Optional

from torch import nn

from ..stages.base import Stage


def claim(stage: Stage, module: nn.Module) -> None:
    """Record on each parameter the stage whose hooks it carries (a weak reference: the
    hooks keep the stage alive as long as they are installed, even when the engine was
    dropped without ``close()``; a ``deepcopy`` of the module is not claimed)."""
    stage.zerotrain_params = frozenset(id(p) for p in module.parameters())
    stage.zerotrain_closed = False
    ref = weakref.ref(stage)
    for p in module.parameters():
        p._zerotrain_stage = ref


def close_stage(stage: Stage, module: nn.Module) -> None:
    """Close ``stage`` (offload resources, hooks, the engine's parameter watch) and release
    ``module``'s parameters; also when the engine object itself is gone."""
    stage.close()
    watch = getattr(stage, "zerotrain_param_watch", None)
    if watch is not None:
        watch.uninstall()
    stage.zerotrain_closed = True
    for p in module.parameters():
        ref = getattr(p, "_zerotrain_stage", None)
        if ref is not None and ref() is stage:
            del p._zerotrain_stage


def open_stage_of(module: nn.Module) -> Optional[tuple[str, Stage]]:
    """The first of ``module``'s parameters (by name) whose hooks belong to an open stage,
    with that stage; None when none is held (Note: one open engine per model)."""
    for name, p in module.named_parameters():
        ref = getattr(p, "_zerotrain_stage", None)
        stage = ref() if ref is not None else None
        if (stage is not None and not getattr(stage, "zerotrain_closed", True)
                and id(p) in stage.zerotrain_params):
            return name, stage
    return None
