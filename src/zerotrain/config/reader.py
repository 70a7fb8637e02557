"""The entry points: user input in, a validated ``ZeroTrainConfig`` or a ``ConfigError`` out.

Sets the order of the reading steps (read the source, walk the keys, canonicalise the
optimizer and scheduler types, resolve the batch sizes, validate, check key combinations,
warn once about DeepSpeed-only keys); each step lives in its own module.
"""
from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Dict, Mapping, Optional, Union

from ..errors import ConfigError
from .batch import _resolve_batch
from .checks import _check_combinations, _check_hierarchical, ignore_param_offload_below_stage3
from .keys import ZeroTrainConfigWarning, unimplemented_message
from .schema import ZeroTrainConfig
from .sections import SCHEDULER_TYPES, ActivationCheckpointingConfig
from .source import _read
from .tensor_parallel import (check_other_parallelism, sequence_parallel_size,
                              tensor_parallel_size)
from .walk import _choose, _clean, _prepare_optimizer, _reject_auto, _validate, _Walk


def load_config(config: Union[Mapping[str, Any], str, "os.PathLike[str]", None], *,
                world_size: int, warn_unimplemented: bool = True,
                sequence_parallel: Optional[int] = None) -> ZeroTrainConfig:
    """Validate ``config`` (a dict, a JSON file path, or None) for ``world_size`` ranks.

    ``sequence_parallel``: the Ulysses size of an ``mpu`` given to ``initialize``, which
    sets ``sequence_parallel_size``; with S > 1 the batch-size triangle counts the N/S
    data-parallel ranks, as DeepSpeed's does.

    Raises ConfigError for anything unusable; warns once (ZeroTrainConfigWarning) listing the
    DeepSpeed keys that were accepted but are not implemented and what was ignored as
    DeepSpeed ignores it (Note "what DeepSpeed ignores" in ``keys.py``), unless ``warn_unimplemented``
    is false (``initialize`` warns itself, on rank 0, at the user's call). The caller's dict
    is not changed.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("", f"world_size must be an integer >= 1, got {world_size!r}")
    raw = _read(config)
    walk = _Walk()
    data = _clean(ZeroTrainConfig, copy.deepcopy(raw), "", "", walk)  # raw stays as given
    _prepare_optimizer(data, walk)
    scheduler = data.get("scheduler")
    if isinstance(scheduler, dict) and "type" in scheduler:
        scheduler["type"] = _choose(scheduler["type"], SCHEDULER_TYPES, "scheduler.type",
                                    ignore_case=False)
    tensor_parallel_size(data, world_size)   # refuses a size that does not divide the world
    sp = sequence_parallel_size(data, world_size, sequence_parallel)
    if sp > 1:
        data["sequence_parallel_size"] = sp
    _resolve_batch(data, world_size // sp)   # Note "the world of the triangle" in batch.py
    result = _validate(ZeroTrainConfig, data, "", walk)
    result = ignore_param_offload_below_stage3(result)
    _check_combinations(result, walk)
    _check_hierarchical(result.zero_optimization, world_size)
    check_other_parallelism(raw)
    result._raw = raw
    result._unimplemented = list(walk.unimplemented)
    result._ignored = list(walk.ignored)
    if (walk.unimplemented or walk.ignored) and warn_unimplemented:
        warnings.warn(unimplemented_message(walk.unimplemented, walk.ignored),
                      ZeroTrainConfigWarning, stacklevel=2)
    return result


def read_config_dict(config: Any) -> Dict[str, Any]:
    """The config as a plain dict (a private copy), before any validation.

    For the few values needed before the world size is known (``comms_timeout``).
    """
    return _read(config)


def load_activation_checkpointing(config: Union[Mapping[str, Any], str, "os.PathLike[str]",
                                                 None]) -> ActivationCheckpointingConfig:
    """Validate only the ``activation_checkpointing`` section of ``config`` (a dict or a JSON
    path), with the same key checks as ``load_config``; the defaults when it has none.

    For ``checkpointing.configure``, which DeepSpeed scripts call with the config file and
    which needs no world size; the rest of the file is validated by ``initialize``.
    """
    name = "activation_checkpointing"
    section = _read(config).get(name, {})
    _reject_auto(section, name)
    walk = _Walk()
    data = _clean(ActivationCheckpointingConfig, section, name, name, walk)
    return _validate(ActivationCheckpointingConfig, data, name, walk)
