"""What DeepSpeed reports about its compiled ops and its build, answered for zerotrain.

DeepSpeed scripts and tests ask, before using an op, whether it can be built here
(``deepspeed.ops.__compatible_ops__[CPUAdamBuilder.NAME]``), and read the build record
``deepspeed.git_version_info`` and ``deepspeed.utils.torch.required_torch_version``.
zerotrain compiles nothing: the optimizers are torch's (``ops.adam``), so ``cpu_adam`` and
``fused_adam`` are always usable, ``installed_ops`` (prebuilt kernels) is all False, as in
a DeepSpeed installed with ``DS_BUILD_OPS=0``, and the ops zerotrain does not provide
(``async_io``: its NVMe offload writes files with torch) are not compatible, so a test
that needs them skips. A builder's ``load()`` names what to use instead.
"""
from __future__ import annotations

import importlib
from typing import Optional, Union

import torch
from torch.torch_version import TorchVersion

from ..errors import ZeroTrainError

__all__ = ["ALL_OPS", "AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder",
           "CPULionBuilder", "FusedAdamBuilder", "MIN_SWAPPABLE_BYTES", "OpBuilder",
           "compatible_ops", "git_branch", "git_hash", "installed_ops",
           "required_torch_version", "torch_info", "version"]  # noqa: F822 (module __getattr__)

# The smallest tensor DeepSpeed's aio swapper moves (its MIN_AIO_BYTES, 1 MiB); exported
# as deepspeed.runtime.swap_tensor.MIN_SWAPPABLE_BYTES for the scripts that size models by it.
MIN_SWAPPABLE_BYTES = 1024 ** 2


class OpBuilder:
    """One DeepSpeed op: ``NAME``, whether it is usable (``is_compatible``), ``load()``."""

    NAME = "deepspeed_not_implemented"
    USE_INSTEAD = "it is not an op"   # what to use in its place ("": the op works, torch-backed)

    def __init__(self) -> None:
        self.name = self.NAME

    def is_compatible(self, verbose: bool = False) -> bool:
        return not self.USE_INSTEAD

    def load(self, verbose: bool = True):
        if self.USE_INSTEAD:
            raise ZeroTrainError(f"the DeepSpeed op {self.NAME!r} is not provided by "
                                 f"zerotrain (nothing is compiled): {self.USE_INSTEAD}")
        return torch.optim   # the torch-backed op needs no extension module


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    USE_INSTEAD = ""


class FusedAdamBuilder(OpBuilder):
    NAME = "fused_adam"
    USE_INSTEAD = ""


class CPUAdagradBuilder(OpBuilder):
    NAME = "cpu_adagrad"
    USE_INSTEAD = "use torch.optim.Adagrad"


class CPULionBuilder(OpBuilder):
    NAME = "cpu_lion"
    USE_INSTEAD = "Lion is not provided; use Adam, AdamW or SGD"


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    USE_INSTEAD = "offload to nvme writes files with torch and needs no aio op"


ALL_OPS: dict[str, OpBuilder] = {b.NAME: b() for b in (
    OpBuilder, AsyncIOBuilder, CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder,
    FusedAdamBuilder)}


def compatible_ops() -> dict[str, bool]:
    """``deepspeed.ops.__compatible_ops__``: op name -> usable here."""
    return {name: builder.is_compatible() for name, builder in ALL_OPS.items()}


# ``deepspeed.git_version_info``: the DeepSpeed release followed, no git build of it
def _deepspeed_version() -> str:
    return importlib.import_module("zerotrain").DEEPSPEED_VERSION   # loaded by then


git_hash = "[none]"
git_branch = "[none]"
installed_ops: dict[str, bool] = dict.fromkeys(ALL_OPS, False)   # nothing prebuilt
torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "bf16_support": False,
    "cuda_version": ".".join((torch.version.cuda or "0.0").split(".")[:2]),
    "nccl_version": "0.0",
    "hip_version": "0.0",
}


def __getattr__(name: str):
    if name == "version":
        return _deepspeed_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def required_torch_version(min_version: Optional[Union[str, float]] = None,
                           max_version: Optional[Union[str, float]] = None) -> bool:
    """Whether the running torch lies within [min_version, max_version] (DeepSpeed's
    ``deepspeed.utils.torch.required_torch_version``)."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version needs min_version or max_version")
    running = TorchVersion(torch.__version__.split("+")[0])
    if min_version is not None and running < str(min_version):
        return False
    if max_version is not None and running > str(max_version):
        return False
    return True
