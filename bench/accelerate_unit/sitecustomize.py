"""Harness adaptation for running Accelerate's DeepSpeed tests on 2 CPU ranks (``run.sh``).

Python imports ``sitecustomize`` at start-up when it is on ``PYTHONPATH``, so this runs in
every process of the run: pytest, and each process ``accelerate launch`` starts. It touches
no test:

* ``ZEROTRAIN_AS_DEEPSPEED=1``: installs zerotrain's ``deepspeed`` switch, with the
  runner's CPU fix for Accelerate (``zerotrain/as_deepspeed.py``, Note "Accelerate on a
  CPU host"), as ``zerotrain launch --as-deepspeed`` or the installed alias would.
* In both modes, lifts the hardware gates of ``accelerate.test_utils.testing``
  (``require_non_cpu``, ``require_cuda``, ``require_multi_device``, ``require_multi_gpu``,
  ``require_cuda_or_hpu``) once that module has run, and makes its ``device_count`` 2,
  so the tests written for GPUs run on 2 CPU ranks. Other gates (DeepSpeed,
  transformers, fp16) stay.
"""
import importlib.abc
import importlib.machinery
import os
import sys

_GATES = ("require_non_cpu", "require_cuda", "require_multi_device", "require_multi_gpu",
          "require_cuda_or_hpu")


def _lift(module) -> None:
    for name in _GATES:
        if hasattr(module, name):
            setattr(module, name, lambda test_case: test_case)
    module.device_count = 2


class _AfterTesting(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "accelerate.test_utils.testing":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _lift(module)

            spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterTesting())

if os.environ.get("ZEROTRAIN_AS_DEEPSPEED") == "1":
    from zerotrain import as_deepspeed

    as_deepspeed.install()
    later = getattr(as_deepspeed, "accelerate_on_cpu_when_imported", None)   # older zerotrain:
    if later is not None:                                                     # none
        later()
