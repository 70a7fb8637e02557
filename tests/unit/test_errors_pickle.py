"""Every exception class zerotrain defines survives pickle (a worker's error reaches its parent).

``multiprocessing`` sends a worker's exception to the parent pickled; one whose ``__init__``
does not accept its own ``args`` fails to unpickle there, which kills the pool's result
thread and leaves the parent waiting forever.
"""
import importlib
import inspect
import pickle
import pkgutil

import pytest

import zerotrain


def _package_exceptions() -> list[type]:
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(zerotrain.__path__, "zerotrain."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (inspect.isclass(value) and issubclass(value, BaseException)
                    and value.__module__.startswith("zerotrain")):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[k] for k in sorted(found)]


EXCEPTIONS = _package_exceptions()


def _instance(cls: type) -> BaseException:
    """cls built from its required arguments, each a distinct string."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values()][1:]
    args = [f"arg{i}" for i, p in enumerate(params)
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty]
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        args = ["what went wrong"]
    return cls(*args)


def test_the_walk_finds_the_error_classes():
    names = {c.__name__ for c in EXCEPTIONS}
    assert {"ConfigError", "StateError", "CheckpointError", "RefusedGlobal",
            "UnsupportedFeatureError", "DeepSpeedInstalledError"} <= names


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda c: c.__name__)
def test_round_trips_through_pickle(cls):
    error = _instance(cls)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error)


def test_config_error_keeps_its_fields():
    error = zerotrain.errors.ConfigError("zero_optimization.stage", "must be 0-3", value=7,
                                         suggestion="did you mean 3")
    back = pickle.loads(pickle.dumps(error))
    assert (back.path, back.message, back.value, back.suggestion) == (
        "zero_optimization.stage", "must be 0-3", 7, "did you mean 3")
    assert str(back) == "zero_optimization.stage: must be 0-3 (did you mean 3)"
