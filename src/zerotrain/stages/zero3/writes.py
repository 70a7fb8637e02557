"""Writes into partitioned parameters while ``zero.Init`` is active.

Note: every init path
    A model built under ``zero.Init`` often re-initialises its parameters after they are
    partitioned (nanoGPT's ``self.apply(self._init_weights)``, transformers' ``post_init``).
    Three paths reach a partitioned parameter, and each is made to write full values:

    * ``torch.nn.init`` functions, also where they were bound by name before the context
      (``from torch.nn.init import xavier_uniform_`` in torch's own modules, and
      transformers' ``initialization.TORCH_INIT_FUNCTIONS``): replaced for the context by
      a wrapper that gathers the parameter, runs the function on the full value with the
      same random stream on every rank, and keeps rank 0's result (:func:`bound_initializers`);
    * any other in-place operation on the parameter or on its ``.data`` (``p.normal_()``,
      ``p.data.fill_(0)``): a ``TorchFunctionMode`` sees an in-place call whose target is a
      registered placeholder and runs it the same way (:class:`PartitionedWrites`);
    * assigning ``p.data`` a full tensor cannot be seen when it happens; the stage refuses
      such a parameter by name when it is handed to ``initialize`` (``unit.py``).

    So whatever path an init takes, the values equal those of plain construction with the
    same seed; none of them trains from the untouched construction-time values silently.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                  "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                  "kaiming_normal_", "orthogonal_", "sparse_")
# torch modules that import init functions by name (transformers patches the same list)
_TORCH_MODULES = ("torch.nn.init", "torch.nn.modules.activation",
                  "torch.nn.modules.transformer", "torch.nn.modules.linear",
                  "torch.nn.modules.loss", "torch.nn.modules.batchnorm",
                  "torch.nn.modules.conv", "torch.nn.modules.normalization",
                  "torch.nn.modules.rnn", "torch.nn.modules.sparse")


def bound_initializers() -> Iterator[tuple[Any, str, Callable]]:
    """(owner, name, original) for every place an init function of torch is bound now:
    module attributes, and transformers' table when transformers is imported."""
    originals: dict[str, Callable] = {name: getattr(torch.nn.init, name) for name in INIT_FUNCTIONS
                 if hasattr(torch.nn.init, name)}
    for module_name in _TORCH_MODULES:
        module = sys.modules.get(module_name)
        for name, fn in originals.items():
            if module is not None and getattr(module, name, None) is fn:
                yield module, name, fn
    hf = sys.modules.get("transformers.initialization")
    table = getattr(hf, "TORCH_INIT_FUNCTIONS", None)
    if isinstance(table, dict):
        for name, fn in list(table.items()):
            if originals.get(name) is fn:
                yield table, name, fn


def skipped_by_transformers() -> Iterator[tuple[Any, str, Callable]]:
    """(owner, name, what to run instead) for each init function that transformers'
    ``no_init_weights`` has replaced by its no-op (torch's ``nn.init`` functions and
    ``PreTrainedModel.init_weights``), which it does around ``zero.Init`` when it builds a
    model for DeepSpeed ZeRO-3 (Note: the same weights through transformers' ZeRO-3 path,
    in zero_init.py)."""
    hf = sys.modules.get("transformers.initialization")
    table = getattr(hf, "TORCH_INIT_FUNCTIONS", None)
    if not isinstance(table, dict):
        return
    assert hf is not None   # the table was read from it

    def skipped(fn: Any) -> bool:
        return (callable(fn) and getattr(fn, "__name__", "") == "empty_func"
                and getattr(fn, "__module__", "") == hf.__name__)

    for module_name in _TORCH_MODULES:
        module = sys.modules.get(module_name)
        for name, fn in table.items():
            if module is not None and skipped(getattr(module, name, None)):
                yield module, name, fn
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if pretrained is not None and skipped(pretrained.__dict__.get("init_weights")):
        yield pretrained, "init_weights", _hf_init_weights


def loading_pretrained() -> bool:
    """Whether transformers is building a model to load a checkpoint into under ZeRO-3
    (``from_pretrained``'s init context): its ``no_tie_weights`` is active besides
    ``no_init_weights`` (``from_config`` enters only the latter). Note: a load draws
    nothing, in zero_init.py."""
    hf = sys.modules.get("transformers.initialization")
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if hf is None or pretrained is None:
        return False
    tie = pretrained.__dict__.get("tie_weights")
    return (getattr(tie, "__name__", "") == "empty_func"
            and getattr(tie, "__module__", "") == hf.__name__
            and next(skipped_by_transformers(), None) is not None)


def per_module_initializers() -> Iterator[tuple[Any, str, Callable]]:
    """(owner, name, original) for transformers' per-module init step
    (``PreTrainedModel._initialize_weights``), when transformers is imported. Some of its
    writes go through an index of the parameter (``init.zeros_(weight[padding_idx])`` for an
    embedding with a padding index), which no path above can see on an empty placeholder;
    ``Init`` runs each step on the module's gathered parameters instead."""
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    original = None if pretrained is None else pretrained.__dict__.get("_initialize_weights")
    if callable(original):
        yield pretrained, "_initialize_weights", original


def _hf_init_weights(model: Any) -> None:
    """``PreTrainedModel.init_weights`` as transformers defines it: initialise (each module
    once, flagged ``_is_hf_initialized``), then tie; the modules' later rank-0 pass then
    finds them initialised and draws nothing."""
    model.initialize_weights()
    model.tie_weights(recompute_mapping=False)


# in-place methods that change a tensor's metadata or autograd flags, not its values
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "resize_", "resize_as_", "set_",
                         "as_strided_", "detach_", "rename_", "refine_names_", "squeeze_",
                         "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_"})


class PartitionedWrites(TorchFunctionMode):
    """Runs in-place operations on partitioned parameters (or their ``.data``) on the full
    value (Note: every init path). ``run(param, fn)`` gathers ``param``, calls ``fn`` on
    its full data and partitions it again."""

    def __init__(self, run: Callable[[torch.Tensor, Callable], None]) -> None:
        super().__init__()
        self._run = run
        self._owners: dict[int, torch.Tensor] = {}

    def register(self, param: torch.Tensor) -> None:
        """``param``'s current placeholder is its empty ``.data`` (call after each change)."""
        self._owners[param.untyped_storage()._cdata] = param

    def owner(self, tensor: torch.Tensor):
        if tensor.numel() != 0:
            return None
        key = tensor.untyped_storage()._cdata
        param = self._owners.get(key)
        if param is None or param.untyped_storage()._cdata != key or param.numel() != 0:
            return None
        return param

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        if (name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES
                and isinstance(target, torch.Tensor)):
            param = self.owner(target)
            if param is not None:
                self._run(param, lambda full: func(full, *args[1:], **kwargs))
                self.register(param)
                return target
        return func(*args, **kwargs)
