"""Names that Accelerate and transformers import only when DeepSpeed is available, filled
in when the DeepSpeed switch is installed after they were imported.

Why: ``accelerate.utils``, ``accelerate.accelerator`` and ``transformers.trainer`` ask
``is_deepspeed_available()`` once, when they are imported, and import their DeepSpeed
wrappers (``DeepSpeedSchedulerWrapper``, ``DummyOptim``...) only if it said yes;
``transformers.integrations.deepspeed`` picks the base class of ``HfDeepSpeedConfig`` the
same way. A script that imports them before ``zerotrain.as_deepspeed.install()`` would
otherwise find those names missing later (``from accelerate.utils import
DeepSpeedSchedulerWrapper`` in ``transformers.trainer`` raises ImportError). So
:func:`refresh` gives each such module, if already imported, what its gated import would
have given it, and re-imports ``transformers.integrations.deepspeed`` when it was built
without Accelerate's base class (its classes are imported by name only inside functions).
Modules not yet imported need nothing: they ask when they are imported.
"""
from __future__ import annotations

import importlib
import sys

# module -> the names its ``if is_deepspeed_available():`` block imports from
# accelerate.utils.deepspeed (Accelerate 1.15, transformers 5)
GATED: dict[str, tuple[str, ...]] = {
    "accelerate.utils": ("DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper",
                         "DeepSpeedSchedulerWrapper", "DummyOptim", "DummyScheduler",
                         "HfDeepSpeedConfig", "get_active_deepspeed_plugin",
                         "map_pytorch_optim_to_deepspeed"),
    "accelerate.accelerator": ("DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper",
                               "DeepSpeedSchedulerWrapper", "DummyOptim", "DummyScheduler",
                               "map_pytorch_optim_to_deepspeed"),
    "transformers.trainer": ("DeepSpeedSchedulerWrapper",),
}
_HF_DEEPSPEED = "transformers.integrations.deepspeed"


def refresh() -> list[str]:
    """Fill the gated names into the modules already imported; return those touched."""
    touched = []
    # a module still being imported (its check is what installs the switch, through the
    # alias's finder) runs its own gated import next: leave it alone
    loaded = [name for name in GATED if name in sys.modules
              and not _initializing(sys.modules[name])]
    if loaded:
        source = importlib.import_module("accelerate.utils.deepspeed")
        for name in loaded:
            module = sys.modules[name]
            missing = [n for n in GATED[name] if not hasattr(module, n)]
            for attr in missing:
                setattr(module, attr, getattr(source, attr))
            if missing:
                touched.append(name)
    hf = sys.modules.get(_HF_DEEPSPEED)
    if hf is not None and not _initializing(hf) and getattr(hf, "DeepSpeedConfig", None) is object:
        reload_hf_deepspeed()
        touched.append(_HF_DEEPSPEED)
    return touched


def reload_hf_deepspeed() -> None:
    """Re-import ``transformers.integrations.deepspeed`` (its config class takes its base
    from whether DeepSpeed is importable now) and point the names other modules hold on its
    old classes at the new ones."""
    hf = sys.modules[_HF_DEEPSPEED]
    before = _own_classes(hf)
    importlib.reload(hf)
    _rebind(before, _own_classes(hf))


def _own_classes(module) -> dict[str, type]:
    return {name: value for name, value in vars(module).items()
            if isinstance(value, type) and value.__module__ == module.__name__}


def _rebind(before: dict[str, type], after: dict[str, type]) -> None:
    """Point every name that transformers and Accelerate hold on a class of the reloaded
    module (``transformers.integrations.HfDeepSpeedConfig``, imported before the reload) at
    the new class: an object made from the old one would not pickle (``torch.save`` of the
    Trainer's arguments: "not the same object as ...HfDeepSpeedConfig")."""
    renamed = {id(old): after[name] for name, old in before.items() if name in after}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(("transformers", "accelerate")) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            new = renamed.get(id(value))
            if new is not None and value is before.get(new.__name__):
                setattr(module, attr, new)


def _initializing(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))
