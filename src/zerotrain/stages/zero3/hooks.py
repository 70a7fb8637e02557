"""The module hooks that drive the :class:`~zerotrain.stages.zero3.scheduler.UnitScheduler`:
a pre- and post-forward hook on every module, which gather and release the units the
module roots or uses (Note "entry points" in ``scheduler.py``) and keep the forward stack
of DeepSpeed's usage records (``usage.py``), the gradient hooks that start a unit's
backward, and setting them aside around a compiled unit (Note "compiled units" in
``stage.py``)."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .ds_attrs import ds_param
from .scheduler import UnitScheduler
from .unit import Unit
from .usage import UsageRecords


def install_module_hooks(root: nn.Module, units: list[Unit],
                         scheduler: UnitScheduler, usage: UsageRecords) -> list[Any]:
    """Forward hooks on every module: those that root or use a unit gather it (Note: entry
    points), all keep the forward stack of ``usage``; the root's first pre-hook starts a
    pass."""
    handles = [root.register_forward_pre_hook(lambda m, a: scheduler.begin_pass())]
    users = unit_users(root, units)
    for module in root.modules():
        indices = tuple(users.get(module, ()))
        handles.append(module.register_forward_pre_hook(
            functools.partial(_before_forward, scheduler, usage, indices), with_kwargs=True))
        # always_call: a forward that raises still lets go of its unit (torch's
        # checkpoint ends a recomputation by raising inside the last operation that
        # saves a tensor)
        handles.append(module.register_forward_hook(
            functools.partial(_after_forward, scheduler, usage, indices), always_call=True))
    return handles


def unit_users(root: nn.Module, units: list[Unit]) -> dict[nn.Module, list[int]]:
    """Module -> the non-persistent units it needs gathered when called on its own."""
    owner = {id(p): u.spec.index for u in units if not u.spec.persistent
             for p in u.spec.params}
    users: dict[nn.Module, list[int]] = {}
    for unit in units:
        if not unit.spec.persistent:
            users.setdefault(unit.spec.module, []).append(unit.spec.index)
    for module in root.modules():
        used = list(module.parameters(recurse=False))
        used += getattr(module, "_zerotrain_external_params", [])
        own = users.get(module, [])
        for p in used:
            index = owner.get(id(p))
            if index is not None and index not in own:
                own.append(index)
        if own:
            users[module] = own
    return users


@contextlib.contextmanager
def hooks_set_aside(handles: list[Any]) -> Iterator[None]:
    """Take the hooks of ``handles`` out of their modules for the duration; put every dict
    back as it was, in its order (``zero3/stage.py``, Note: compiled units)."""
    saved = []
    for handle in handles:
        for ref in (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ())):
            hooks = ref()
            if hooks is not None and handle.id in hooks:
                saved.append((hooks, list(hooks.items())))
                del hooks[handle.id]
    try:
        yield
    finally:
        for hooks, items in reversed(saved):
            hooks.clear()
            hooks.update(items)


def _before_forward(scheduler: UnitScheduler, usage: UsageRecords, indices: tuple[int, ...],
                    module: nn.Module, args: tuple, kwargs: dict) -> None:
    usage.push(module)
    inputs = None
    for index in indices:
        if not scheduler.enter(index, module) or not torch.is_grad_enabled():
            continue
        if inputs is None:
            inputs = [v for v in pytree.tree_leaves((args, kwargs))
                      if isinstance(v, torch.Tensor) and v.requires_grad]
        if inputs:   # Note: end of a unit's backward (a hook, not a wrapper: inputs stay
            # as they are, so a forward may still modify them in place)
            scheduler.expect_inputs_backward(index)
            torch.autograd.graph.register_multi_grad_hook(
                inputs, functools.partial(_inputs_done, scheduler, index), mode="all")


def _inputs_done(scheduler: UnitScheduler, index: int, grads: Any) -> None:
    scheduler.inputs_backward_done(index)


def _after_forward(scheduler: UnitScheduler, usage: UsageRecords, indices: tuple[int, ...],
                   module: nn.Module, args: Any, output: Any) -> None:
    usage.pop(module)
    params = returned_params(output)
    if not params and not indices:
        return
    usage.returned(module, params)
    units = [ds_param(p).ds_unit.spec for p in params]
    returned = {spec.index for spec in units if not spec.persistent}
    for index in indices:
        for unit in sorted(returned):   # Note: returned parameters (scheduler.py)
            scheduler.pin(unit, index)
        if scheduler.leave(index, module) and torch.is_grad_enabled():
            _start_backward_on_grad(scheduler, index, module, output)


def _start_backward_on_grad(scheduler: UnitScheduler, index: int, module: nn.Module,
                            output: Any) -> None:
    """The first gradient of ``module``'s output starts the unit's backward."""
    fired: list[bool] = []

    def on_grad(grad):
        if not fired:
            fired.append(True)
            scheduler.before_backward(index, module)
        return grad

    for tensor in _tensors(output):
        if not tensor.requires_grad:
            continue
        if tensor.grad_fn is not None:
            # on the node, not the tensor: a node's pre-hooks run after the tensor hooks
            # that tell the next unit (in forward order) its backward is done, so that
            # unit is released before this one is gathered
            tensor.grad_fn.register_prehook(lambda grad_outputs: on_grad(None))
        else:
            tensor.register_hook(on_grad)


def returned_params(output: Any) -> list[torch.Tensor]:
    """The stage-3 parameters (or views of them) in ``output``, each once."""
    if type(output) is torch.Tensor and (output._base is None
                                         or not hasattr(output._base, "ds_unit")):
        return []   # the common case, an activation: answered without a walk
    found: list[torch.Tensor] = []
    tensors = list(_tensors(output))
    if not tensors and hasattr(output, "__dict__") and not isinstance(output, nn.Module):
        # a plain object holding the outputs, as DeepSpeed also looks into
        tensors = [v for v in vars(output).values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        param = tensor if isinstance(tensor, nn.Parameter) else tensor._base
        if (param is not None and getattr(param, "ds_unit", None) is not None
                and not any(p is param for p in found)):
            found.append(param)
    return found


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors inside nested tuples, lists, dicts (model outputs) and dataclasses."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from _tensors(getattr(value, name, None))
