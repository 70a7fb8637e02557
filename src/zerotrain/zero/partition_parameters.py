"""``deepspeed.runtime.zero.partition_parameters``: ``deepspeed.zero``'s names plus the
tensor-constructor wrapper transformers swaps while it builds a model under ``zero.Init``.

DeepSpeed's ``zero.Init`` wraps ``torch.empty``/``zeros``/``arange``... with
``zero_wrapper_for_fp_tensor_constructor`` to create tensors on the accelerator in the
training dtype; transformers replaces the wrapper (``prevent_arange_dtype_change``) so that
``torch.arange`` keeps its dtype. zerotrain's ``Init`` partitions parameters once each module
is built and never rewrites constructors, so ``arange`` keeps its dtype either way; the
wrapper is here so that code reading or replacing it runs, and it behaves as DeepSpeed's
when called.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch

from ..stages.zero3.zero_init import _contradicting_single_rank_pg_error
from . import GatheredParameters, Init, ZeroParamStatus, register_external_parameter
from .linear import zero3_linear_wrap

__all__ = ["GatheredParameters", "Init", "InsertPostInitMethodToModuleSubClasses",
           "MultipleAllGatherHandles", "ZeroParamStatus", "zero3_linear_wrap",
           "_orig_torch_arange", "_orig_torch_empty", "partitioned_param_data_shape",
           "register_external_parameter", "zero_wrapper_for_fp_tensor_constructor",
           "_contradicting_single_rank_pg_error"]

# DeepSpeed's base class of ``zero.Init``: the context that wraps every module class's
# ``__init__`` to partition each module once built. Here that context is ``Init`` itself.
# DeepSpeed also keeps torch's ``F.linear`` on it as ``linear_bk`` when it puts
# ``zero3_linear_wrap`` in its place for the rest of the process (``memory_efficient_linear``);
# zerotrain never replaces ``F.linear`` (docs/from-deepspeed.md, "Deliberate differences"),
# so the attribute never exists.
InsertPostInitMethodToModuleSubClasses = Init

# DeepSpeed's names for the unwrapped constructors (zerotrain's Init replaces neither)
_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty

# The shape of a partitioned parameter's ``.data`` while it is released (an empty
# placeholder; the values live in ``ds_tensor``), under DeepSpeed's name.
partitioned_param_data_shape = [0]


class MultipleAllGatherHandles:
    """Several gather handles waited on as one (DeepSpeed's ``all_gather_coalesced`` result
    over several groups): ``wait`` passes ``handle_dependency`` to each by keyword, so a
    handle whose ``wait`` takes it keyword-only or as ``**kwargs`` gets it too."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: Optional[Any] = None) -> Callable:
    """``fn`` creating its tensor on ``target_device`` (unless given one) and casting a
    floating-point result to ``target_fp_dtype``, as DeepSpeed's wrapper does."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor
    return wrapped
