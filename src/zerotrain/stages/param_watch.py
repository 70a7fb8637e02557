"""A module's ``_parameters`` while an engine trains it (DeepSpeed's ``ZeROOrderedDict``):
parameters the engine does not hold are named, and at stage 3 a released parameter read in
forward is gathered.

Note: parameters the engine does not hold
    An engine partitions (stage 3) and steps the parameters the model has at
    ``initialize``. A module attached afterwards (``model.head = nn.Linear(...)``), or a
    parameter registered or replaced afterwards (``model.fc.weight = nn.Parameter(...)``,
    ``load_state_dict(..., assign=True)``), is not among them: its forward runs on its
    whole tensor and backward computes its gradient, but no optimizer steps it, and at
    stage 3 with several ranks each rank keeps its own values. Training goes on and that
    part of the model silently never learns. So at ``initialize`` every module's
    ``_parameters`` becomes a :class:`TrackedParameters` (at stage 3 a
    :class:`ZeROOrderedDict`) bound to the engine's :class:`ParameterWatch`: its
    ``__setitem__`` (the path of ``register_parameter`` and of assigning a parameter
    attribute) notes a parameter the engine does not hold, and at the start of each forward
    of the model the watch walks its modules, as DeepSpeed's forward prologue does, and
    adopts those whose container is not its own (attached since), noting their parameters.
    The first forward after such a parameter appears logs one warning naming it (each
    parameter once). It is a warning, not an error: the forward itself is right, and
    DeepSpeed runs it without a word. The walk costs one ``type`` check per module per
    forward; reads (``module.weight``) stay torch's own at stages 0-2.

Note: external parameters at stage 3
    Stage 3's hooks gather a unit for the modules its plan knows use it (``zero3/hooks.py``,
    Note "entry points" in ``zero3/scheduler.py``). A forward that reads another module's
    parameter directly (``F.linear(x, self.child.weight)`` in the parent, the parameters
    DeepSpeed calls external) reads the empty placeholder of a released unit and fails with
    a size mismatch. :class:`ZeROOrderedDict`'s ``__getitem__`` (the path of
    ``module.weight``) gathers such a parameter's unit when it is read during the model's
    forward, through the stage's ``gather_external`` (the scheduler's pin: the unit stays
    gathered until the micro-step's backward ends, which its saved views need), as
    DeepSpeed's getter gathers it and registers it as external. Every rank runs the same
    forward, so every rank gathers it at the same point; the gather carries its header
    (Note "gather check" in ``zero3/gather_check.py``). Reads outside the model's forward
    (``GatheredParameters``, ``param.ds_tensor``) gather nothing. The cost is a Python call
    per parameter read at stage 3 (docs/from-deepspeed.md gives the measured step time).
    Once the engine compiles the model (``engine.compile``, ``compile.enabled``) the
    containers read as OrderedDict's again (``ParameterWatch.plain_reads``): dynamo would
    otherwise specialise each block's graph on its container (one graph per block instead
    of one for all, ``tests/dist/test_compile.py``), and a traced read gathers nothing
    anyway. A compiled model's external reads need ``register_external_parameter``, as
    before; parameters added after initialize are still named.
"""
from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .zero3.ds_attrs import ZeroParamStatus

logger = logging.getLogger(__name__)

__all__ = ["ParameterWatch", "TrackedParameters", "ZeROOrderedDict",
           "ensure_zero_ordered_dict"]

# ds_status while its unit is released, or gathering ahead of use (prefetch)
_NOT_GATHERED = (ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT)
_getitem = OrderedDict.__getitem__

# the watches of open engines, and torch's global registration hooks that mark them stale
# (Note: parameters the engine does not hold); hooked once per process, on first install
_WATCHES: "weakref.WeakSet[ParameterWatch]" = weakref.WeakSet()
_REGISTRATION_HOOKS: list = []


def _registered(*_args) -> None:
    """A module or parameter was registered somewhere: every watch walks its model at its
    next forward. Returns None: torch keeps what was registered."""
    for watch in _WATCHES:
        watch.stale = True


def _hook_registrations() -> None:
    if not _REGISTRATION_HOOKS:
        from torch.nn.modules import module as torch_module
        _REGISTRATION_HOOKS.extend([
            torch_module.register_module_module_registration_hook(_registered),
            torch_module.register_module_parameter_registration_hook(_registered)])


class TrackedParameters(OrderedDict):
    """``module._parameters`` bound to a :class:`ParameterWatch` (Note: parameters the
    engine does not hold); reads are OrderedDict's. ``_watch`` None: a plain container."""

    def __init__(self, parent_module: nn.Module, *args, **kwargs) -> None:
        self._parent_module = parent_module
        self._watch: Optional[ParameterWatch] = None
        self._own_in_forward = False
        super().__init__(*args, **kwargs)

    def __reduce__(self):
        # a copy (deepcopy, pickle) is a plain container of the same class: it does not
        # take the engine (the watch and its stage) with it
        return (type(self), (self._parent_module,), None, None, iter(self.items()))

    def __setitem__(self, key: str, value) -> None:
        super().__setitem__(key, value)
        watch = self._watch
        if watch is not None and value is not None and id(value) not in watch.known:
            watch.note(value)

    @property
    def _in_forward(self) -> bool:
        """DeepSpeed's flag: the model's forward is running (one flag per watch)."""
        watch = self._watch
        return watch.in_forward if watch is not None else self._own_in_forward

    @_in_forward.setter
    def _in_forward(self, value: bool) -> None:
        if self._watch is not None:
            self._watch.in_forward = bool(value)
        else:
            self._own_in_forward = bool(value)


class ZeROOrderedDict(TrackedParameters):
    """DeepSpeed's ``_parameters`` container at stage 3: a released parameter read during
    the model's forward is gathered (Note: external parameters at stage 3)."""

    def __getitem__(self, key: str):
        param = _getitem(self, key)
        if torch.compiler.is_compiling():   # a traced read: no guard on the unit's status
            return param
        if getattr(param, "ds_status", None) in _NOT_GATHERED and self._in_forward:
            watch = self._watch
            if watch is not None and watch.gather_external is not None:
                watch.gather_external(param)
        return param


def ensure_zero_ordered_dict(module, *, watch: Optional["ParameterWatch"] = None) -> None:
    """Make ``module._parameters`` a :class:`ZeROOrderedDict` (DeepSpeed's helper): a plain
    ``dict`` (torch's default) or ``OrderedDict`` is copied into one, keeping the first
    original container in ``module._original_parameters``; one already converted stays.
    Nothing happens when ``_parameters`` is missing or not a dict. ``watch`` (zerotrain's)
    binds the container, and the parameters it does not hold are noted."""
    _convert(module, ZeROOrderedDict, watch)


def _convert(module, cls: type[TrackedParameters], watch: Optional["ParameterWatch"]) -> None:
    params = getattr(module, "_parameters", None)
    if not isinstance(params, dict):
        return
    if not isinstance(params, cls):
        if not hasattr(module, "_original_parameters"):
            module._original_parameters = params
        converted = cls(module)
        for key, param in params.items():
            OrderedDict.__setitem__(converted, key, param)
        module._parameters = params = converted
    if watch is not None and params._watch is not watch:
        params._watch = watch
        for param in params.values():
            if param is not None and id(param) not in watch.known:
                watch.note(param)


class ParameterWatch:
    """The parameters an engine holds, and the ones that appeared in its model since
    (Note: parameters the engine does not hold). ``known``: ids of the held parameters;
    ``gather_external``: stage 3's gather of a released parameter read in forward (Note:
    external parameters at stage 3), None below stage 3."""

    def __init__(self, root: nn.Module, known: Iterable[int], *,
                 gather_external: Optional[Callable[[nn.Parameter], None]] = None) -> None:
        self.root = root
        self.known = frozenset(known)
        self.gather_external = gather_external
        self.in_forward = False
        self._cls: type[TrackedParameters] = (ZeROOrderedDict if gather_external is not None
                                              else TrackedParameters)
        self._noted: dict[int, nn.Parameter] = {}
        self._warned: set[int] = set()
        self._handles: list = []
        self.stale = False   # a module or parameter was registered since the last walk

    def install(self) -> None:
        """Bind every module's container and hook the model's forward (once)."""
        _hook_registrations()
        for module in self.root.modules():
            _convert(module, self._cls, self)
        self.stale = False
        _WATCHES.add(self)
        self._handles = [
            self.root.register_forward_pre_hook(lambda m, a: self.begin_forward()),
            self.root.register_forward_hook(lambda m, a, o: self.end_forward(),
                                            always_call=True)]

    def uninstall(self) -> None:
        """Unhook and unbind; the containers stay (unbound, they act as plain ones)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        _WATCHES.discard(self)
        for module in self.root.modules():
            params = module.__dict__.get("_parameters")
            if isinstance(params, TrackedParameters) and params._watch is self:
                params._watch = None
        self.in_forward = False

    def plain_reads(self) -> None:
        """The model is compiled: reads go back to OrderedDict's (Note: external
        parameters at stage 3); the containers still note parameters."""
        self._cls = TrackedParameters
        for module in self.root.modules():
            params = module.__dict__.get("_parameters")
            if type(params) is ZeROOrderedDict and params._watch is self:
                # the container changes class in place, which mypy reads as a narrowing
                # of its declared type (ZeROOrderedDict, checked just above)
                params.__class__ = TrackedParameters  # type: ignore[assignment]

    def note(self, param: nn.Parameter) -> None:
        if id(param) not in self._warned:
            self._noted[id(param)] = param

    def begin_forward(self) -> None:
        """The model's forward starts: adopt modules attached since the last one (where
        anything was registered since), warn once about parameters the engine does not
        hold, and let the getters gather."""
        if self.stale:
            self.stale = False
            cls = self._cls
            for module in self.root.modules():
                params = module.__dict__.get("_parameters")
                if type(params) is not cls or params._watch is not self:
                    _convert(module, cls, self)
        if self._noted:
            self._warn()
        self.in_forward = True

    def end_forward(self) -> None:
        self.in_forward = False

    def _warn(self) -> None:
        present = [(name, p) for name, p in self.root.named_parameters()
                   if id(p) in self._noted]
        self._noted.clear()
        if not present:   # added and removed again before a forward
            return
        self._warned.update(id(p) for _, p in present)
        listed = ", ".join(f"{n} {tuple(p.shape)}" for n, p in present)
        logger.warning(
            "parameters added to the model after initialize are not trained by this engine: "
            "%s. Their forward uses their whole values and backward computes their "
            "gradients, but no optimizer steps them (stage 3 does not partition them "
            "either, so each rank keeps its own values). Attach every module before "
            "initialize, or close this engine and initialize a new one over the model",
            listed)
