"""Imported by the forkserver of a ``run.sh`` run (``sitecustomize.py`` lists it): warm it up.

Every distributed test of DeepSpeed's harness starts a fresh ``multiprocessing`` pool, and each
rank is forked from the forkserver. A rank then unpickles the test (importing the test module
and everything it imports) and, on the first optimizer or compile-adjacent call, torch's lazily
imported ``torch._dynamo`` family: about 800 modules and 3 s of CPU per rank on an idle core,
half a minute on 2 cores shared with other work. Imported here once, in the forkserver, they
are inherited by every rank of every test through ``fork``; the ranks then run the test with
nothing left to import.

The parent writes what to import into the JSON file named by ``DS_UNIT_FORKSERVER_PRELOAD``:
its ``sys.path`` (pytest puts each test folder there) and the modules it has imported by then
(every collected test module), in import order. A module that fails to import here is left
alone: the rank imports it as before and fails or skips there, as it would have.
"""
import json
import os
import sys

# Imported on first use (an optimizer's constructor, ``torch.compile``, numpy's RNG), not at
# ``import torch`` or ``import deepspeed``: each rank would import them again in every test.
# A name that does not import (DeepSpeed's, through the switch) is skipped.
LAZY = ("torch._dynamo", "torch._inductor.compile_fx", "torch.onnx",
        "torch.testing._internal.distributed.fake_pg", "torch.nn.utils._expanded_weights",
        "numpy.random", "statistics", "getpass", "deepspeed.runtime.zero.muon.muon_optimizer")


def _preload() -> None:
    listing = os.environ.get("DS_UNIT_FORKSERVER_PRELOAD")
    if not listing:
        return
    with open(listing) as f:
        wanted = json.load(f)
    sys.path[:] = wanted["path"]
    for name in [*wanted["modules"], *LAZY]:
        if name in sys.modules:
            continue
        try:
            __import__(name)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - a module-level pytest.skip is a BaseException
            pass



def _cache_cpu_info() -> None:
    """DeepSpeed's op builders call py-cpuinfo's ``get_cpu_info()`` (twice per optimizer), which
    runs a child Python each time: 5 s a call on an idle core. The CPU does not change during
    the run, so the forkserver asks once and every rank gets a copy of that answer."""
    try:
        import cpuinfo
    except ImportError:
        return
    info = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: dict(info)


_preload()
_cache_cpu_info()
