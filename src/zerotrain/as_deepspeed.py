"""Run an unmodified DeepSpeed script on zerotrain: ``deepspeed`` imports resolve here.

    zerotrain launch --as-deepspeed --nproc_per_node 2 train.py --deepspeed_config ds.json
    python -m zerotrain.as_deepspeed train.py ...        (one process, no launcher)
    zerotrain.as_deepspeed.install()                     (in code, before `import deepspeed`)

After :func:`install`, in this process only, ``import deepspeed``, ``import deepspeed.comm
as dist``, ``from deepspeed.accelerator import get_accelerator``, ``from deepspeed.ops.adam
import FusedAdam``... give zerotrain's implementations (:data:`ALIASES` lists every name).
A ``deepspeed`` module zerotrain does not provide raises ``ModuleNotFoundError`` naming it;
a missing attribute raises ``AttributeError`` naming it. The real DeepSpeed is never
shadowed: when it is importable, :func:`install` refuses with :class:`DeepSpeedInstalledError`.

Like DeepSpeed's launcher, the runner passes ``--local_rank=<LOCAL_RANK>`` to the script
(``--no_local_rank`` turns that off, as in DeepSpeed). Run without a launcher, it sets
the launcher's variables first, as DeepSpeed's launcher of one process would (Note: the
launcher's variables).

Note: aliases, not copies
    Each ``deepspeed.X`` is a small module object that forwards attribute reads to its
    zerotrain module, so ``deepspeed.comm.get_rank is zerotrain.comm.get_rank`` and no
    zerotrain module is ever loaded twice. Aliases (not the zerotrain modules themselves)
    go into ``sys.modules``, because the import system sets each submodule as an attribute
    of its parent: aliasing ``deepspeed.utils.logging`` straight to ``zerotrain.utils``
    would overwrite the ``logging`` module inside ``zerotrain.utils``.

Note: rebinding deepspeed.comm's functions
    Scripts and DeepSpeed's tests wrap ``deepspeed.comm``'s collectives by assigning to the
    module (``dist.all_reduce = counting_wrapper``, restored after), because DeepSpeed's
    stages call them through it. An assignment to one of ``zerotrain.comm``'s functions on
    the ``deepspeed.comm`` alias rebinds it in ``zerotrain.comm``, through which zerotrain's
    own collectives launch (Note "public launch points" in ``comm/communicator.py``), so
    the wrapper sees them; assigning the original back restores it. Other names, and every
    other alias, are set on the alias alone (a child module the import system attaches,
    say, must not land in the zerotrain module).

Note: versions
    ``deepspeed.__version__`` (and ``__version_major__``/``_minor__``/``_patch__``, as
    DeepSpeed exports them) is ``zerotrain.DEEPSPEED_VERSION``, the DeepSpeed release whose
    API and checkpoint format zerotrain follows, so a script's
    ``version.parse(deepspeed.__version__) >= version.parse("0.10.0")`` takes the branch
    written for that DeepSpeed. zerotrain's own version stays ``zerotrain.__version__``,
    also readable as ``deepspeed.__zerotrain_version__``.

Note: distribution metadata
    transformers' ``is_deepspeed_available`` and Accelerate's check ask
    ``importlib.metadata`` for a ``deepspeed`` distribution, not just for an importable
    module. While installed, the finder also answers ``importlib.metadata`` (its
    ``find_distributions``) with a distribution built in memory: name ``deepspeed``,
    version ``zerotrain.DEEPSPEED_VERSION``. Nothing is written to disk; after
    :func:`uninstall`, or in any other process, ``deepspeed`` has no metadata again.

Note: installing late
    :func:`install` may be called at any point before the first ``import deepspeed``, also
    after Accelerate or transformers were imported: those ask ``is_deepspeed_available()``
    once, at import, and import their DeepSpeed wrappers only if it said yes, so the
    modules already imported are given those names then
    (``integrations/deepspeed_gates.py``). :func:`uninstall` leaves them there.

Note: the launcher's variables
    Run without a launcher, :func:`main` sets what DeepSpeed's launcher
    (``deepspeed/launcher/launch.py``) sets for one process on one node: ``RANK=0``,
    ``LOCAL_RANK=0``, ``WORLD_SIZE=1``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT=29500``,
    ``LOCAL_SIZE=1``, ``CROSS_RANK=0``, ``CROSS_SIZE=1`` (the Trainer on the CPU needs the
    rendezvous address). Under torchrun, whose variables stay as they are, the three
    DeepSpeed-only names are derived from torchrun's (``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK``). A variable already set is never changed.

Note: Accelerate on a CPU host
    Accelerate (which the ``Trainer`` runs on) picks the process-group backend from the
    devices it finds; on a host with none it finds no backend for its DeepSpeed path, still
    calls ``deepspeed.comm.init_distributed`` (so DeepSpeed's world has N ranks), but then
    records one process: every rank reads all the data and the batch size is computed for
    one rank (the real DeepSpeed then fails its batch-size check the same way). The runner
    (:func:`main`, not :func:`install`) therefore gives Accelerate's backend choice
    ``gloo`` in that one case (DeepSpeed requested, a launcher's ``LOCAL_RANK`` set, no
    backend found), as its non-DeepSpeed CPU path does. With a GPU nothing changes.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import re
import os
import runpy
import sys
import types
from typing import Any, Callable, Optional, Sequence

from .errors import ZeroTrainError

__all__ = ["ALIASES", "DeepSpeedInstalledError", "install", "installed", "main", "uninstall"]

# deepspeed module name -> zerotrain module it forwards to (None: a package of aliases only)
ALIASES: dict[str, Optional[str]] = {
    "deepspeed": "zerotrain",
    "deepspeed.accelerator": "zerotrain.accelerator",
    "deepspeed.comm": "zerotrain.comm",
    "deepspeed.comm.comm": "zerotrain.comm",
    "deepspeed.ops": "zerotrain.ops",
    "deepspeed.ops.adam": "zerotrain.ops.adam",
    "deepspeed.ops.adam.fused_adam": "zerotrain.ops.adam",
    "deepspeed.ops.adam.cpu_adam": "zerotrain.ops.adam",
    "deepspeed.utils": "zerotrain.utils",
    "deepspeed.utils.logging": "zerotrain.utils",
    "deepspeed.utils.zero_to_fp32": "zerotrain.checkpoint.consolidate",
    "deepspeed.zero": "zerotrain.zero",
    "deepspeed.checkpointing": "zerotrain.checkpointing",
    "deepspeed.moe": "zerotrain.moe",
    "deepspeed.moe.experts": "zerotrain.moe.experts",
    "deepspeed.moe.layer": "zerotrain.moe.layer",
    "deepspeed.moe.utils": "zerotrain.moe.utils",
    "deepspeed.pipe": "zerotrain.pipe",
    "deepspeed.runtime": None,
    "deepspeed.runtime.engine": "zerotrain",
    "deepspeed.runtime.zero": "zerotrain.zero",
    "deepspeed.runtime.zero.partition_parameters": "zerotrain.zero.partition_parameters",
    "deepspeed.runtime.zero.stage3": "zerotrain.estimate",          # the memory estimators
    "deepspeed.runtime.zero.stage_1_and_2": "zerotrain.estimate",
    "deepspeed.runtime.activation_checkpointing": None,
    "deepspeed.runtime.activation_checkpointing.checkpointing": "zerotrain.checkpointing",
    "deepspeed.runtime.lr_schedules": "zerotrain.schedules",
    "deepspeed.runtime.dataloader": "zerotrain.dataloader",
    "deepspeed.runtime.utils": "zerotrain.core.runtime_utils",
    "deepspeed.runtime.pipe": "zerotrain.pipe",
    "deepspeed.runtime.pipe.engine": "zerotrain.pipe",
    "deepspeed.runtime.pipe.module": "zerotrain.pipe",
    # Trainer and Accelerate through the switch
    "deepspeed.checkpoint": None,
    "deepspeed.checkpoint.utils": "zerotrain.checkpoint.ds_utils",
    "deepspeed.runtime.zero.offload_config": "zerotrain.offload_names",
    # ``accelerate launch --use_deepspeed`` (its launcher's constants only)
    "deepspeed.launcher": None,
    "deepspeed.launcher.runner": "zerotrain.launcher_names",
    # Ulysses sequence parallelism (ALST)
    "deepspeed.utils.groups": "zerotrain.comm.groups",
    "deepspeed.runtime.sequence_parallel": None,
    "deepspeed.runtime.sequence_parallel.ulysses_sp": "zerotrain.sequence.ulysses_sp",
    "deepspeed.runtime.sequence_parallel.parallel_state_sp": "zerotrain.comm.parallel_state_sp",
}
# DeepSpeed's names its own unit tests and their harness import: build and op records,
# runtime.zero.config's models, and the optimizer classes for isinstance (optim_kinds).
ALIASES.update({
    "deepspeed.accelerator.real_accelerator": "zerotrain.accelerator",
    "deepspeed.git_version_info": "zerotrain.ops.builder",
    "deepspeed.ops.op_builder": "zerotrain.ops.builder",
    "deepspeed.ops.aio": "zerotrain.ops.builder",
    "deepspeed.utils.torch": "zerotrain.ops.builder",
    "deepspeed.runtime.swap_tensor": "zerotrain.ops.builder",
    "deepspeed.runtime.zero.config": "zerotrain.config.deepspeed_zero",
    "deepspeed.runtime.zero.stage3": "zerotrain.optim_kinds",          # and the estimators
    "deepspeed.runtime.zero.stage_1_and_2": "zerotrain.optim_kinds",
    "deepspeed.runtime.zero.utils": "zerotrain.optim_kinds",   # ZeRORuntimeException
    "deepspeed.runtime.base_optimizer": "zerotrain.optim_kinds",
    "deepspeed.runtime.bf16_optimizer": "zerotrain.optim_kinds",
    "deepspeed.runtime.fp16": None,
    "deepspeed.runtime.fp16.fused_optimizer": "zerotrain.optim_kinds",
    "deepspeed.runtime.fp16.unfused_optimizer": "zerotrain.optim_kinds",
})
# More of DeepSpeed's own ZeRO unit tests: the leaf-module defaults.
ALIASES.update({
    "deepspeed.runtime.zero.leaf_module_config": "zerotrain.config.zero",
    "deepspeed.runtime.zero.tiling": "zerotrain.zero.tiling",
    "deepspeed.runtime.zero.offload_states": "zerotrain.utils",   # get_state_devices
    "deepspeed.runtime.zero.linear": "zerotrain.zero.linear",
    # ZeROOrderedDict, ensure_zero_ordered_dict (Note "parameters the engine does not hold")
    "deepspeed.runtime.zero.parameter_offload": "zerotrain.stages.param_watch",
})
_FORWARDED_DUNDERS = frozenset({"__all__", "__compatible_ops__"})  # others: the alias's
# aliases whose functions a script may rebind (Note: rebinding deepspeed.comm's functions)
_WRITABLE = frozenset({"deepspeed.comm", "deepspeed.comm.comm"})
_GUIDE = "see docs/from-deepspeed.md, 'The API, name by name', for what zerotrain provides"


def _deepspeed_version_part(index: int) -> int:
    return int(importlib.import_module("zerotrain").DEEPSPEED_VERSION.split(".")[index])


# ``deepspeed``'s version attributes (Note: versions)
_VERSIONS: dict[str, Callable[[], Any]] = {
    "__version__": lambda: importlib.import_module("zerotrain").DEEPSPEED_VERSION,
    "__version_major__": lambda: _deepspeed_version_part(0),
    "__version_minor__": lambda: _deepspeed_version_part(1),
    "__version_patch__": lambda: _deepspeed_version_part(2),
    "__zerotrain_version__": lambda: importlib.import_module("zerotrain").__version__,
}


class DeepSpeedInstalledError(ZeroTrainError, RuntimeError):
    """The real DeepSpeed is importable; zerotrain will not hide it behind its own names."""


class _Alias(types.ModuleType):
    """``deepspeed.X``: attribute reads go to the zerotrain module (Note: aliases)."""

    def __init__(self, name: str, target: Optional[str]) -> None:
        super().__init__(name, f"zerotrain's stand-in for {name} (forwards to {target})")
        self.__zerotrain_target__ = target

    def __getattr__(self, attr: str):
        if self.__name__ == "deepspeed" and attr in _VERSIONS:   # Note: versions
            return _VERSIONS[attr]()
        child = f"{self.__name__}.{attr}"
        if child in ALIASES:
            return importlib.import_module(child)
        target = self.__dict__.get("__zerotrain_target__")
        if target is not None and (not attr.startswith("__") or attr in _FORWARDED_DUNDERS):
            try:
                return getattr(importlib.import_module(target), attr)
            except AttributeError:
                pass
        raise AttributeError(f"{child} is not provided by zerotrain ({_GUIDE})")

    def __setattr__(self, attr: str, value: Any) -> None:
        """Note: rebinding deepspeed.comm's functions."""
        target = self.__dict__.get("__zerotrain_target__")
        if self.__dict__.get("__name__") in _WRITABLE and not attr.startswith("__"):
            module = importlib.import_module(target)
            if isinstance(getattr(module, attr, None), types.FunctionType) or (
                    callable(value) and not isinstance(value, types.ModuleType)
                    and attr in self.__dict__.get("__zerotrain_rebound__", ())):
                setattr(module, attr, value)
                self.__dict__.setdefault("__zerotrain_rebound__", set()).add(attr)
                return
        super().__setattr__(attr, value)

    def __dir__(self) -> list[str]:
        target = self.__dict__.get("__zerotrain_target__")
        names = set(super().__dir__())
        if target is not None:
            names |= set(dir(importlib.import_module(target)))
        return sorted(names)


class _Distribution(importlib.metadata.Distribution):
    """``deepspeed``'s metadata, in memory only (Note: distribution metadata)."""

    def read_text(self, filename: str) -> Optional[str]:
        zt = importlib.import_module("zerotrain")
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {zt.DEEPSPEED_VERSION}\n"
                    f"Summary: zerotrain {zt.__version__} standing in for DeepSpeed "
                    f"{zt.DEEPSPEED_VERSION} (zerotrain launch --as-deepspeed)\n"
                    "Author: zerotrain\n")
        if filename == "top_level.txt":
            return "deepspeed\n"
        return None

    def locate_file(self, path) -> pathlib.Path:
        return pathlib.Path(os.path.dirname(os.path.abspath(__file__))) / str(path)


def _wants_deepspeed(name: Optional[str]) -> bool:
    return name is None or re.sub(r"[-_.]+", "-", name).lower() == "deepspeed"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every ``deepspeed`` import while installed: an alias, or a clear error.

    Also the ``importlib.metadata`` finder of the ``deepspeed`` distribution.
    """

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        """``importlib.metadata``'s hook (Note: distribution metadata)."""
        return iter([_Distribution()] if _wants_deepspeed(context.name) else [])

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        if fullname not in ALIASES:
            raise ModuleNotFoundError(
                f"{fullname} is not provided by zerotrain, which runs this script in place "
                f"of DeepSpeed ({_GUIDE})", name=fullname)
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec) -> types.ModuleType:
        return _Alias(spec.name, ALIASES[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        target = ALIASES[module.__name__]
        if target is not None:
            importlib.import_module(target)   # import errors surface at the import line


_FINDER = _Finder()


def installed() -> bool:
    return _FINDER in sys.meta_path


def install() -> None:
    """Make ``deepspeed`` imports resolve to zerotrain in this process.

    Raises DeepSpeedInstalledError when the real DeepSpeed is importable (or imported).
    """
    if installed():
        return
    loaded = sys.modules.get("deepspeed")
    if loaded is not None and not isinstance(loaded, _Alias):
        raise DeepSpeedInstalledError(
            f"DeepSpeed is already imported in this process (from "
            f"{getattr(loaded, '__file__', '?')}); zerotrain will not replace it")
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        where = spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]
        raise DeepSpeedInstalledError(
            f"the real DeepSpeed is importable in this environment ({where}); zerotrain will "
            "not shadow it. Run the script where DeepSpeed is not installed, or change its "
            "import to `import zerotrain as deepspeed`")
    sys.meta_path.insert(0, _FINDER)
    if "accelerate" in sys.modules or "transformers" in sys.modules:   # Note: installing late
        from .integrations.deepspeed_gates import refresh
        refresh()


def uninstall() -> None:
    """Undo :func:`install`: remove the finder and every ``deepspeed`` alias module."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n, m in sys.modules.items() if isinstance(m, _Alias)]:
        del sys.modules[name]


def _accelerate_on_cpu() -> None:
    """Give Accelerate's DeepSpeed path ``gloo`` on a host without devices (Note:
    Accelerate on a CPU host); a no-op without Accelerate or with CUDA."""
    if importlib.util.find_spec("accelerate") is None:
        return
    import torch
    if torch.cuda.is_available():
        return
    from accelerate.state import PartialState
    original = PartialState.__dict__.get("_prepare_backend")
    if original is None or getattr(original, "__zerotrain__", False):
        return

    def _prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend=None):
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        if (chosen is None and not cpu and os.environ.get("LOCAL_RANK", "-1") != "-1"
                and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"):
            chosen = "gloo"
        return chosen, kind

    _prepare_backend.__zerotrain__ = True   # type: ignore[attr-defined]
    PartialState._prepare_backend = _prepare_backend


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` right after module ``name`` is first executed (once)."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module: types.ModuleType) -> None:
            exec_module(module)
            then()

        spec.loader.exec_module = exec_then
        return spec


def accelerate_on_cpu_when_imported() -> None:
    """The runner's CPU fix for Accelerate (Note: Accelerate on a CPU host), for processes
    a launcher started with the switch installed lazily (``deepspeed_alias.py``): now if
    ``accelerate.state`` is imported, else right after it is."""
    if "accelerate.state" in sys.modules:
        _accelerate_on_cpu()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("accelerate.state", _accelerate_on_cpu))


def _launcher_environment(env: Any) -> None:
    """DeepSpeed's launcher's variables, never overriding one (Note: the launcher's
    variables)."""
    if not any(k in env for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")):   # no launcher
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
            env.setdefault(key, value)
    local = env.get("LOCAL_WORLD_SIZE", "1" if env.get("WORLD_SIZE") == "1" else None)
    if local is not None:
        env.setdefault("LOCAL_SIZE", local)
        env.setdefault("CROSS_RANK", env.get("GROUP_RANK", "0"))
        if local.isdigit() and int(local) and env.get("WORLD_SIZE", "").isdigit():
            env.setdefault("CROSS_SIZE", str(int(env["WORLD_SIZE"]) // int(local)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m zerotrain.as_deepspeed [--no_local_rank] (script.py | -m module) args``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    no_local_rank = bool(argv) and argv[0] == "--no_local_rank"
    argv = argv[1:] if no_local_rank else argv
    as_module = bool(argv) and argv[0] == "-m"
    argv = argv[1:] if as_module else argv
    if not argv:
        print("usage: python -m zerotrain.as_deepspeed [--no_local_rank] "
              "(script.py | -m module) [args...]", file=sys.stderr)
        return 2
    target, args = argv[0], argv[1:]
    install()
    _accelerate_on_cpu()
    _launcher_environment(os.environ)
    if not no_local_rank and "LOCAL_RANK" in os.environ:
        args = [f"--local_rank={os.environ['LOCAL_RANK']}", *args]
    if as_module:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":  # run the imported module's main, so one finder exists
    from zerotrain.as_deepspeed import main as _main
    sys.exit(_main())
