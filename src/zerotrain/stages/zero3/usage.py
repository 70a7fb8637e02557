"""Who uses what at stage 3, in DeepSpeed's names: the per-parameter and per-module records
that code written for DeepSpeed's stage 3 reads (its lifecycle tests, debugging helpers).
The module hooks (``hooks.py``) and the scheduler (``scheduler.py``) keep them current;
nothing here decides a gather or a release.

Note: usage records
    ``module.ds_id``
        the module's place in ``root.modules()`` (DeepSpeed numbers modules too).
    ``param.ds_active_sub_modules``
        the ``ds_id`` of every module using the parameter's unit now: a module between its
        forward pre-hook and post-hook (the modules inside a unit too; a module called
        recursively stays in until its outermost call ends), and the module whose output's
        gradient started the unit's backward, until that backward is done (Note "end of a
        unit's backward" in ``scheduler.py``). zerotrain gathers units, not parameters, so
        the set is the unit's, shared by its parameters: keeping it costs one dictionary
        update per hook, whatever the unit's size. Persistent units are gathered once and
        have no hooks: their set stays empty.
    ``module.ds_recompute_parameters``
        the parameters that a recomputation of the module's forward (activation
        checkpointing, inside backward) left gathered for the backward that follows (the
        scheduler kept their unit: Note "trace and prefetch"); they leave the set when that
        backward takes the hold over, or when the hold is dropped.
    ``param.is_external_param``, ``module._external_params``, ``module.ds_external_parameters()``
        a parameter that a module's forward returns (Note "returned parameters" in
        ``scheduler.py``) is registered, ``{id(param): param}``, with the innermost module
        whose forward is still running, its caller, unless a module on that forward stack
        has it already; the module that returned it gives up its own registration (its
        caller covers the use now), and the parameter's ``is_external_param`` becomes True
        for good (DeepSpeed's rules). ``zero.register_external_parameter`` registers there
        too. What keeps such a parameter gathered is the scheduler's pin; these records say
        where it went.

    The per-call records (active modules, recompute parameters) are emptied when backward
    ends and when a new pass starts after a backward that never ended (an exception in it),
    as every unit is released then.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .ds_attrs import ds_module, ds_param
from .unit import Unit


class ExternalParameters:
    """``module.ds_external_parameters()``: the ``(id, parameter)`` items of the module's
    ``_external_params``, the method DeepSpeed's stage 3 gives every module (TRL's
    generation block reads it). A callable object rather than a bound function, so the
    module still pickles and deep-copies."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self):
        return getattr(self.module, "_external_params", {}).items()


class UsageRecords:
    """DeepSpeed's usage records over ``root`` and its ``units`` (Note: usage records)."""

    def __init__(self, root: nn.Module, units: list[Unit]) -> None:
        self._units = units
        self._stack: list[nn.Module] = []   # modules whose forward is running, outermost first
        self._active: list[set[int]] = [set() for _ in units]   # the sets the parameters show
        self._calls: list[dict[int, int]] = [{} for _ in units]   # module id -> calls running
        self._backward: list[set[int]] = [set() for _ in units]   # modules whose grad began it
        self._recompute: dict[int, nn.Module] = {}   # kept unit -> the module that kept it
        for number, module in enumerate(root.modules()):
            ds = ds_module(module)
            ds.ds_id = number
            ds.ds_recompute_parameters = set()
            if not isinstance(getattr(module, "_external_params", None), dict):
                ds._external_params = {}
            if not hasattr(module, "ds_external_parameters"):
                ds.ds_external_parameters = ExternalParameters(module)
        for unit, active in zip(units, self._active):
            for p in unit.spec.params:
                ds_param(p).ds_active_sub_modules = active
                if not hasattr(p, "is_external_param"):
                    ds_param(p).is_external_param = False

    # ------------------------------------------------------------------ forward
    def push(self, module: nn.Module) -> None:
        """``module``'s forward starts."""
        self._stack.append(module)

    def pop(self, module: nn.Module) -> None:
        """``module``'s forward ended (or raised)."""
        stack = self._stack
        if stack and stack[-1] is module:
            stack.pop()
            return
        for k in range(len(stack) - 1, -1, -1):   # hooks set aside in between: find it
            if stack[k] is module:
                del stack[k:]
                return

    def entered(self, index: int, module: nn.Module) -> None:
        """A module using unit ``index`` starts its forward."""
        calls = self._calls[index]
        key = ds_module(module).ds_id
        running = calls.get(key, 0)
        calls[key] = running + 1
        if not running:
            self._active[index].add(key)

    def left(self, index: int, module: nn.Module) -> None:
        """A module using unit ``index`` ends its forward."""
        calls = self._calls[index]
        key = ds_module(module).ds_id
        running = calls.get(key, 0) - 1
        if running > 0:
            calls[key] = running
            return
        calls.pop(key, None)
        if key not in self._backward[index]:
            self._active[index].discard(key)

    def returned(self, module: nn.Module, params: Iterable[torch.Tensor]) -> None:
        """``module``'s forward (already popped) returned ``params`` (DeepSpeed's rules)."""
        for p in params:
            key = id(p)
            if any(key in getattr(m, "_external_params", ()) for m in self._stack):
                continue
            ds_param(p).is_external_param = True
            if self._stack:
                _external(self._stack[-1])[key] = p
            _external(module).pop(key, None)

    # ------------------------------------------------------------------ backward
    def backward_began(self, index: int, module: nn.Module) -> None:
        """The gradient of ``module``'s output starts unit ``index``'s backward."""
        key = ds_module(module).ds_id
        self._backward[index].add(key)
        self._active[index].add(key)

    def backward_done(self, index: int) -> None:
        """Unit ``index``'s backward is done (the scheduler let go of it)."""
        began = self._backward[index]
        for key in began:
            if key not in self._calls[index]:
                self._active[index].discard(key)
        began.clear()

    def kept_in_recompute(self, index: int, module: nn.Module) -> None:
        """A recomputation of ``module``'s forward kept unit ``index`` for its backward."""
        self.unkept(index)
        ds_module(module).ds_recompute_parameters.update(self._units[index].spec.params)
        self._recompute[index] = module

    def unkept(self, index: int) -> None:
        """Unit ``index`` is no longer kept (its hold passed on, or was dropped)."""
        module = self._recompute.pop(index, None)
        if module is not None:
            ds_module(module).ds_recompute_parameters.difference_update(
                self._units[index].spec.params)

    def reset(self) -> None:
        """Every unit released: no module uses one any more."""
        for index in list(self._recompute):
            self.unkept(index)
        for active, calls, began in zip(self._active, self._calls, self._backward):
            active.clear()
            calls.clear()
            began.clear()
        self._stack.clear()


def _external(module: nn.Module) -> dict:
    """``module._external_params``, made on first use (a module added after set-up)."""
    found = getattr(module, "_external_params", None)
    if not isinstance(found, dict):
        found = ds_module(module)._external_params = {}
    return found


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread now."""
    return torch._C._current_graph_task_id() != -1
