"""What stage 3's module hooks offer beyond gathering: their handles (DeepSpeed's
``forward_hooks``), set aside and registered again around TRL's generation, the compile
targets that keep them outside each compiled block (Note "compiled units" in ``stage.py``),
and the warning on a ``state_dict()`` of partitioned placeholders."""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

import torch
from torch import nn

from ...errors import StateError
from ..base import CompileTarget
from . import partition as P
from .ds_attrs import ds_module
from .hooks import hooks_set_aside, install_module_hooks, unit_users
from .scheduler import UnitScheduler
from .unit import Unit

logger = logging.getLogger(f"{__package__}.stage")   # the stage's logger, as scripts filter it


class UnitHooks:
    """The stage's hook handles as the engine, TRL's generation and compile see them
    (mixed into ``PartitionedDataParallel``, which installs the hooks)."""

    module: nn.Module
    units: list[Unit]
    scheduler: UnitScheduler
    _handles: list[Any]

    def forward_hook_handles(self) -> list[Any]:
        """The handles of the module hooks that gather units in forward (DeepSpeed's
        ``forward_hooks``); none while :meth:`forward_hooks_set_aside` holds them."""
        if getattr(self, "_forward_hooks_aside", False):
            return []
        dicts = {id(d) for m in self.module.modules()
                 for d in (m._forward_pre_hooks, m._forward_hooks)}
        return [h for h in self._handles if id(h.hooks_dict_ref()) in dicts]

    def reinstall_forward_hooks(self) -> None:
        """The forward hooks registered afresh on every module (DeepSpeed's
        ``_register_deepspeed_module`` on the root, which TRL calls after removing them
        around generation); any still registered are removed first, so none runs twice.
        The scheduler's trace is re-recorded at the next pass. Local."""
        if getattr(self, "_forward_hooks_aside", False):
            raise StateError("stage 3's forward hooks cannot be registered again inside "
                             "unwrap_model_for_generation, which puts them back at its end")
        old = self.forward_hook_handles()
        for handle in old:
            handle.remove()
        gone = {id(h) for h in old}
        self._handles = install_module_hooks(self.module, self.units, self.scheduler,
                                             self.scheduler.usage) + [
            h for h in self._handles if id(h) not in gone]
        self.scheduler.forget_trace()

    @contextlib.contextmanager
    def forward_hooks_set_aside(self) -> Iterator[None]:
        """The forward hooks out of the modules for the block, back after in their order
        (DeepSpeed's ``unwrap_model_for_generation``; the caller gathers the parameters)."""
        handles = self.forward_hook_handles()
        self._forward_hooks_aside = True
        try:
            with hooks_set_aside(handles):
                yield
        finally:
            self._forward_hooks_aside = False

    def compile_targets(self, module: nn.Module) -> list[CompileTarget]:
        """Unit modules that contain no other unit module (the blocks): their forwards
        compile whole while the hooks that gather them stay outside (Note "compiled
        units")."""
        own: dict[int, set[int]] = {}
        for u in self.units:
            if not u.spec.persistent:
                own.setdefault(id(u.spec.module), set()).add(u.spec.index)
        hooked = {id(module)} | set(own)
        users = unit_users(self.module, self.units)
        targets = []
        for name, sub in module.named_modules():
            inner = list(sub.modules())[1:]
            if id(sub) not in hooked or any(id(m) in hooked for m in inner):
                continue
            quiet = {id(d) for m in inner if set(users.get(m, ())) <= own.get(id(sub), set())
                     for d in (m._forward_pre_hooks, m._forward_hooks)}
            handles = [h for h in self._handles if id(h.hooks_dict_ref()) in quiet]
            targets.append(CompileTarget(name, sub, functools.partial(hooks_set_aside,
                                                                      handles)))
        return targets


def warn_if_partitioned(module: nn.Module, state_dict: dict, prefix: str,
                         local_metadata: Any) -> None:
    """``model.state_dict()`` outside ``GatheredParameters`` holds the partitioned
    parameters' empty placeholders (as in DeepSpeed); saving it (``torch.save``,
    ``save_pretrained``) would write an empty model without a word, so say so, once per
    model. ``state_dict(keep_vars=True)`` (for its keys; zerotrain's own calls) is quiet."""
    if getattr(module, "_zerotrain_warned_state_dict", False):
        return
    for name, param in module.named_parameters():
        value = state_dict.get(prefix + name)
        if (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
                and P.is_partitioned(param) and value.shape != P.full_shape(param)):
            ds_module(module)._zerotrain_warned_state_dict = True
            logger.warning(
                "state_dict() of a ZeRO stage-3 model holds partitioned parameters, e.g. "
                "%r of shape %s for %s: saving it writes no weights. Use "
                "engine.save_16bit_model(dir), save_checkpoint and `zerotrain consolidate`, "
                "or call state_dict() inside zerotrain.zero.GatheredParameters(...)",
                prefix + name, tuple(value.shape), tuple(P.full_shape(param)))
            return
