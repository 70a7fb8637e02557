"""``torch.compile`` under a ZeRO stage: which modules are compiled, and what a failure does.

Note: what is compiled
    Stages 0-2 reach the module only through hooks on parameters (post-accumulate-grad),
    and those run in the autograd engine after a compiled backward has produced the
    gradient, exactly as after an eager one. So the whole module's forward is compiled as
    one function. Stage 3 gathers and releases parameters in forward hooks on its units'
    modules (``stages/zero3/scheduler.py``); traced into a graph, those hooks (collectives, ``.data``
    swaps) break it or force a recompilation every step. So stage 3 compiles per unit:
    each unit module that contains no other unit module (a transformer block, with the
    default ``stage3_prefetch_bucket_size``) gets a compiled forward, and the hooks that
    gather and release it run around it, eagerly; the hooks of the modules inside, which
    only count nesting there, are set aside during the call (``zero3/stage.py``, Note:
    compiled units). A module inside a block that uses another unit's parameter (a tied or
    external one) keeps its hooks, which then gather that unit inside the graph and break
    it there. A unit whose
    module contains another unit (a block split into several units because it is larger
    than ``stage3_prefetch_bucket_size``) runs eagerly, as does code outside every unit
    (the root's own forward: embeddings, head, loss). The stage names its targets
    (``Stage.compile_targets``); this module only compiles.

Note: forward, not __call__
    ``nn.Module.compile()`` compiles ``_call_impl``, the module's hooks included. Here the
    compiled function replaces the instance's ``forward`` attribute instead, so
    ``module(x)`` still dispatches the hooks in Python and only the body is traced. The
    blocks of a model share one code object, so one graph serves them all (dynamo
    guards on shapes, dtypes and grad mode, not on which block runs it): after the first
    step nothing is compiled again unless a shape, dtype or mode changes.

Note: no CUDA graphs at stage 3
    CUDA graphs (``mode="reduce-overhead"``, ``mode="max-autotune"``, the ``cudagraphs``
    backend, inductor's ``triton.cudagraphs`` option) replay kernels on the addresses they
    were recorded with. Stage 3 frees each unit's full parameters after use and gathers
    them again, into storage that can move, between the hooks and the graph: a replay
    would read freed or stale memory with no error. So ``Compilation`` refuses them at
    stage 3 with a ConfigError naming ``compile.mode`` (or the backend, or the option),
    before any module is changed; stages 0-2 keep their parameters in place and may use
    them.

Note: failures
    A backend that does not exist is refused when ``compile`` is called, before any module
    is changed. A backend that fails on a block does so at that block's first forward:
    the error names the block and the backend. With ``fallback="eager"`` that block, and
    every block sharing its code, runs eagerly from then on, with a warning.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn

from ..errors import CompileError, ConfigError
from ..stages.base import CompileTarget
from ..stages.factory import stage_class

logger = logging.getLogger(__name__)

__all__ = ["CompileSettings", "Compilation", "EngineCompile", "refuse_precompiled"]

FALLBACKS = (None, "eager")
# torch.compile modes that record CUDA graphs (Note: no CUDA graphs at stage 3)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class CompileSettings:
    """What ``torch.compile`` gets for every target.

    ``backend``: a registered backend name or a callable ``(GraphModule, inputs) ->
    callable``; ``mode``: torch's ``mode`` (None, "default", "reduce-overhead",
    "max-autotune", ...); ``options``: the remaining ``torch.compile`` keyword arguments
    (``fullgraph``, ``dynamic``, ``options``); ``fallback``: None (a failure raises) or
    "eager" (the failing block runs eagerly).
    """

    backend: Union[str, Callable[..., Any]] = "inductor"
    mode: Optional[str] = None
    options: dict[str, Any] = field(default_factory=dict)
    fallback: Optional[str] = None

    def cuda_graphs(self) -> Optional[tuple[str, Any]]:
        """The setting that asks for CUDA graphs, as (config key, value), or None."""
        for mode in (self.mode, self.options.get("mode")):   # a kwargs dict may carry it
            if mode in CUDA_GRAPH_MODES:
                return "compile.mode", mode
        if self.backend_name == "cudagraphs":
            return "compile.backend", self.backend_name
        inductor = self.options.get("options") or {}
        if isinstance(inductor, dict) and inductor.get("triton.cudagraphs"):
            return "compile.options", {"triton.cudagraphs": inductor["triton.cudagraphs"]}
        return None

    @property
    def backend_name(self) -> str:
        if isinstance(self.backend, str):
            return self.backend
        return getattr(self.backend, "__name__", type(self.backend).__name__)


class _CompiledForward:
    """Installed as a target's ``forward``: the compiled body, or the eager one after a
    failure with ``fallback="eager"`` (Note "failures")."""

    def __init__(self, target: CompileTarget, compiled: Callable[..., Any],
                 compilation: "Compilation") -> None:
        self.name = target.name or "<root>"
        self.original = target.module.forward
        self.compiled = compiled
        self.around = target.around or contextlib.nullcontext
        self.compilation = compilation
        self.code = getattr(self.original, "__code__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.code is not None and self.code in self.compilation.failed_code:
            return self.original(*args, **kwargs)
        try:
            with self.around():
                return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:
            return self.compilation.failed(self, exc, args, kwargs)


class Compilation:
    """The compiled forwards of one engine: ``install`` them, ``undo`` to restore the
    eager ones."""

    def __init__(self, targets: list[CompileTarget], settings: CompileSettings, *,
                 stage: int = 0) -> None:
        """Compile every target's current forward (lazily: tracing happens at its first
        call); ``install`` puts them in place.

        Raises ConfigError when the backend does not exist or torch refuses the arguments,
        or when ``stage`` (``zero_optimization.stage``) partitions parameters and the
        settings ask for CUDA graphs.
        """
        if settings.fallback not in FALLBACKS:
            raise ConfigError("compile.fallback", f"expected null or \"eager\", got "
                              f"{settings.fallback!r}", value=settings.fallback)
        graphs = settings.cuda_graphs() if stage_class(stage).partitions_parameters else None
        if graphs is not None:
            key, value = graphs
            raise ConfigError(key, f"{value!r} records CUDA graphs, which replay on fixed "
                              "addresses; stage 3 frees and re-gathers every unit's "
                              "parameters each step, so a replay would read freed or stale "
                              "memory (Note: no CUDA graphs at stage 3 in compile.py)",
                              value=value, suggestion="use mode \"default\" or "
                              "\"max-autotune-no-cudagraphs\", or stages 0-2")
        self.settings = settings
        self.failed_code: set[Any] = set()
        self.fallen_back: list[str] = []
        self.names = [t.name or "<root>" for t in targets]
        self._forwards = [(t.module, _CompiledForward(
            t, self._compile(label, t.module.forward), self))
            for label, t in zip(self.names, targets)]
        self._installed: list[tuple[nn.Module, Optional[Callable[..., Any]]]] = []

    def install(self) -> None:
        """Make the compiled forwards the targets' ``forward``."""
        for module, forward in self._forwards:
            self._installed.append((module, module.__dict__.get("forward")))
            module.forward = forward
        logger.info("torch.compile (backend %s, mode %s): %s", self.settings.backend_name,
                    self.settings.mode, ", ".join(self.names))

    def _compile(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        s = self.settings
        try:
            return torch.compile(forward, backend=s.backend, mode=s.mode, **s.options)
        except torch._dynamo.exc.InvalidBackend:
            raise ConfigError(
                "compile.backend", f"{s.backend_name!r} is not a torch.compile backend "
                f"(compiling block {name!r})", value=s.backend_name,
                suggestion="available: " + ", ".join(torch._dynamo.list_backends())) from None
        except (TypeError, RuntimeError, ValueError) as exc:
            raise ConfigError("compile.kwargs", f"torch.compile refused the arguments for "
                              f"block {name!r} with backend {s.backend_name!r}: "
                              f"{exc}", value=s.options) from None

    def failed(self, target: _CompiledForward, exc: Exception, args: tuple,
               kwargs: dict) -> Any:
        """A target's compilation failed at its first call: raise, or fall back to eager."""
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        what = (f"torch.compile of block {target.name!r} with backend "
                f"{self.settings.backend_name!r} failed: {type(exc).__name__}: {first_line}")
        if self.settings.fallback != "eager":
            raise CompileError(what + " (set \"compile\": {\"fallback\": \"eager\"} to run "
                               "such blocks eagerly, or choose another backend)") from exc
        logger.warning("%s; running it eagerly (compile.fallback is \"eager\")", what)
        if target.code is not None:
            self.failed_code.add(target.code)
        self.fallen_back.append(target.name)
        return target.original(*args, **kwargs)

    def undo(self) -> None:
        """Put the eager forwards back (the compiled code is dropped with them)."""
        for module, previous in reversed(self._installed):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._installed.clear()


def refuse_precompiled(model: nn.Module) -> None:
    """Refuse a module compiled before ``initialize`` (why: Note "forward, not __call__";
    a ``torch.compile`` wrapper also renames every parameter ``_orig_mod.*``)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:   # nothing was compiled in this process (and importing it is slow)
        return
    fix = ("pass the uncompiled module to initialize and let zerotrain compile it: set "
           "\"compile\": {\"enabled\": true} in the config, or call engine.compile() after "
           "initialize")
    if isinstance(model, dynamo.eval_frame.OptimizedModule):
        raise ConfigError("model", f"initialize() got a torch.compile wrapper around "
                          f"{type(model._orig_mod).__name__}; {fix} (the original module "
                          "is model._orig_mod)")
    for name, module in model.named_modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            where = f"submodule {name!r}" if name else "the model"
            raise ConfigError("model", f"{where} was compiled with Module.compile() before "
                              f"initialize; {fix}")

if TYPE_CHECKING:
    from .surface import EngineSurface
else:
    EngineSurface = object   # typing only (surface.py)


class EngineCompile(EngineSurface):
    """The engine's ``compile()``, ``is_compiled`` and ``compiled_modules``: a mixin
    :class:`~zerotrain.engine.ZeroEngine` inherits, reading its ``module`` and ``stage``
    and holding the one :class:`Compilation` in force (``_compilation``)."""

    _compilation: Optional[Compilation]

    def compile(self, backend: Any = "inductor", mode: Optional[str] = None, *,
                compile_kwargs: Optional[dict] = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False, fallback: Optional[str] = None,
                **kwargs: Any) -> None:
        """``torch.compile`` the module the way the stage allows (docs/compile.md): whole
        at stages 0-2, per unit (block) at stage 3, hooks outside the graphs. Call it on
        every rank; it compiles lazily, at each module's first forward.

        ``kwargs`` (or DeepSpeed's ``compile_kwargs`` dict) go to ``torch.compile``;
        ``fallback="eager"`` runs a block that fails to compile eagerly instead of
        raising. Calling it again replaces the earlier compilation. DeepSpeed's
        ``schedule`` (DeepCompile) and ``compiled_autograd_enabled`` are not supported.
        """
        if schedule is not None or compiled_autograd_enabled:
            raise ConfigError("compile", "DeepCompile schedules and compiled autograd are "
                              "not supported; call engine.compile(backend, mode, **kwargs)")
        settings = CompileSettings(backend=backend, mode=mode,
                                   options={**(compile_kwargs or {}), **kwargs},
                                   fallback=fallback)
        previous, self._compilation = self._compilation, None
        if previous is not None:
            previous.undo()
        try:
            compilation = Compilation(self.stage.compile_targets(self.module), settings,
                                      stage=self.zero_optimization_stage())
        except Exception:
            if previous is not None:   # a failed call leaves the engine as it was
                previous.install()
                self._compilation = previous
            raise
        compilation.install()
        self._compilation = compilation
        watch = getattr(self, "_param_watch", None)
        if watch is not None:   # Note "external parameters at stage 3" (param_watch.py)
            watch.plain_reads()

    @property
    def is_compiled(self) -> bool:
        """Whether ``compile`` (or the config's ``compile.enabled``) compiled the module."""
        return self._compilation is not None

    @property
    def compiled_modules(self) -> list[str]:
        """Paths of the modules whose forward is compiled ('<root>': the whole model)."""
        return list(self._compilation.names) if self._compilation else []
