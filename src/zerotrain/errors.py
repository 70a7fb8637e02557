"""The named errors every layer of zerotrain raises.

Each error says what was wrong (a dotted config key, a parameter, a rank) and, where one
exists, the likely fix, so the message alone is enough to act on.
"""
from __future__ import annotations

from typing import Any, Optional


class ZeroTrainError(Exception):
    """Base class of every error zerotrain raises on purpose."""


class ConfigError(ZeroTrainError, ValueError):
    """A configuration value that cannot be used.

    ``path`` is the dotted key (``zero_optimization.stage``), ``value`` the offending value
    and ``suggestion`` a hint such as ``did you mean zero_optimization``.
    """

    def __init__(self, path: str, message: str, *, value: Any = None,
                 suggestion: Optional[str] = None) -> None:
        self.path = path
        self.message = message
        self.value = value
        self.suggestion = suggestion
        text = f"{path}: {message}" if path else message
        if suggestion:
            text += f" ({suggestion})"
        super().__init__(text)

    def __reduce__(self):
        # pickle rebuilds an exception as cls(*args); ours takes (path, message, keywords),
        # and an error that cannot be unpickled hangs a multiprocessing pool that receives it
        return (_rebuild_config_error,
                (type(self), self.path, self.message, self.value, self.suggestion),
                self.__dict__)


def _rebuild_config_error(cls: type, path: str, message: str, value: Any,
                          suggestion: Optional[str]) -> ConfigError:
    return cls(path, message, value=value, suggestion=suggestion)


class AssertedConfigError(ConfigError, AssertionError):
    """A configuration value DeepSpeed refuses with an ``assert`` (an odd
    ``allgather_bucket_size`` at stages 1-2, ``overlap_comm`` with unmanaged accumulation
    at stages 0-1): a ConfigError naming the key, and the ``AssertionError`` code written
    for DeepSpeed catches."""


class RankMismatchError(ZeroTrainError, RuntimeError):
    """Ranks disagree about something that must be identical (model, config, world size)."""


class StateError(ZeroTrainError, RuntimeError):
    """An engine or shard method was called in a state where it cannot run."""


class ContextMisuseError(StateError, AssertionError):
    """``no_sync()`` / ``coalesce_grad_reduction()`` used where they cannot run (a step
    inside, a nesting DeepSpeed refuses, a stage that reduce-scatters every backward).
    DeepSpeed asserts these, so code written for it catches ``AssertionError``: this is
    both, and a StateError."""


class UnusedParameterError(StateError, AssertionError):
    """A trainable parameter got no gradient in an accumulation window while
    ``zero_optimization.ignore_unused_parameters`` is false; raised on every rank. DeepSpeed
    asserts it, so this is also an ``AssertionError``."""


class AccumulationModeError(StateError, AssertionError):
    """A call the accumulation mode does not allow: with ``managed_gradient_accumulation``
    false the caller's ``step()`` is the boundary, so ``set_gradient_accumulation_boundary()``
    and ``coalesce_grad_reduction()`` are refused. DeepSpeed asserts these: this is both."""



class LossValueError(ZeroTrainError, ValueError, AssertionError):
    """A loss that is not one number where one is needed (``engine.scale``). DeepSpeed
    asserts it, so this is also an ``AssertionError``."""


class NonFiniteGradientError(ZeroTrainError, FloatingPointError):
    """A gradient was inf or nan outside fp16 loss scaling, where a skipped step would hide it."""


class CompileError(ZeroTrainError, RuntimeError):
    """``torch.compile`` failed on a module; the message names the module and the backend."""


class CollectiveError(ZeroTrainError, RuntimeError):
    """A collective failed or timed out; the message names it, its shape and its purpose."""


class CheckpointError(ZeroTrainError, RuntimeError):
    """A checkpoint cannot be written or read; the message names the file, key or parameter."""


class RankDivergenceError(RankMismatchError):
    """Ranks took different paths through the model (different units gathered, or different
    collectives in a step); raised on every rank at once, naming where each rank was."""


class TilingError(ZeroTrainError, ValueError, RuntimeError):
    """A ``TiledLinear`` that cannot be built or fed: a split count out of range, an input
    or a source layer of the wrong shape; or a tiled computation along the sequence
    (``sequence/tiled.py``) given a bad shard count, reduction or input shape. A
    ``RuntimeError`` too, as DeepSpeed raises."""
