"""DeepSpeed's ``tensor_parallel`` section (AutoTP training), and the checks it needs.

``autotp_size`` T splits the model's linear layers over groups of T ranks (``zerotrain.tp``);
0 or 1 leaves the model whole. ``partition_config.layer_specs`` adds rules by weight name
(regular expressions, DeepSpeed's ``partition_type`` "row" or "column"), tried before the
built-in ones unless ``use_default_specs`` is false. DeepSpeed's inference-only and tuning
keys (``tp_overlap_comm``, ``dtype``, ``keep_module_on_host``, ``tp`` ...) are accepted and
named in the unimplemented-keys warning (``keys.py``).
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Literal, Mapping, Optional

from pydantic import Field, field_validator

from ..errors import ConfigError
from .fields import _Section


_SPEC_KEYS = {"patterns", "partition_type", "shape", "partition_dim"}
_PARTITION_TYPES = ("row", "column", "skip")


def _check_layer_spec(spec: Any) -> Dict[str, Any]:
    """One rule: weights whose name matches one of ``patterns`` (regular expressions) are
    split ``partition_type``. ``shape``/``partition_dim`` (DeepSpeed's fused-weight hints)
    are kept for ``tp/rules.py`` to refuse by name."""
    if not isinstance(spec, dict):
        raise ValueError(f"each layer spec is an object, got {spec!r}")
    unknown = sorted(set(spec) - _SPEC_KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; a layer spec has {sorted(_SPEC_KEYS)}")
    patterns = spec.get("patterns")
    if not isinstance(patterns, list) or not patterns or not all(
            isinstance(p, str) for p in patterns):
        raise ValueError(f"patterns must be a non-empty list of strings, got {patterns!r}")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"pattern {pattern!r} is not a regular expression: {exc}") from exc
    if spec.get("partition_type") not in _PARTITION_TYPES:
        raise ValueError(f"partition_type must be one of {list(_PARTITION_TYPES)}, got "
                         f"{spec.get('partition_type')!r}")
    return dict(spec)


class PartitionConfig(_Section):
    """``layer_specs``: rules tried before the built-in ones (``tp/rules.py``), each
    ``{"patterns": [...], "partition_type": "row" | "column" | "skip"}``."""

    use_default_specs: bool = True
    layer_specs: List[Dict[str, Any]] = Field(default_factory=list)

    @field_validator("layer_specs")
    @classmethod
    def _specs(cls, value: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        return [_check_layer_spec(spec) for spec in value]


class TensorParallelConfig(_Section):
    """``autotp_size``: ranks per tensor-parallel group (0 or 1: off)."""

    autotp_size: int = Field(0, ge=0)
    partition_config: Optional[PartitionConfig] = None
    preset_model: Optional[Literal["llama", "qwen2", "mistral", "gpt2"]] = None

    @property
    def size(self) -> int:
        """Ranks per tensor-parallel group, 1 when off."""
        return max(1, self.autotp_size)


def tensor_parallel_size(data: Mapping[str, Any], world_size: int) -> int:
    """``tensor_parallel.autotp_size`` of an unvalidated config (1 when unset, 0 or not an
    integer: the schema reports a bad value); ConfigError when it does not divide the world.
    """
    section = data.get("tensor_parallel")
    size = section.get("autotp_size") if isinstance(section, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 1:
        return 1
    if world_size % size:
        raise ConfigError("tensor_parallel.autotp_size",
                          f"{size} does not divide the world size {world_size}; the ranks form "
                          f"a {size} x (world / {size}) mesh", value=size)
    return size


def sequence_parallel_size(data: Mapping[str, Any], world_size: int,
                           given: Optional[int] = None) -> int:
    """The Ulysses size S of an unvalidated config, or ``given`` (an ``mpu``'s, which wins,
    as in DeepSpeed, but must agree with a size the config sets); 1 when unset (the schema
    reports a bad value). ConfigError when S does not divide the world, or with
    ``tensor_parallel.autotp_size`` (one model-parallel mesh at a time)."""
    size = data.get("sequence_parallel_size")
    size = size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else 1
    if given is not None:
        if size > 1 and size != given:
            raise ConfigError("sequence_parallel_size", f"{size} differs from the mpu's "
                              f"sequence-parallel world size {given}", value=size)
        size = given
    if size > 1 and world_size % size:
        raise ConfigError("sequence_parallel_size", f"{size} does not divide the world size "
                          f"{world_size}", value=size)
    if size > 1 and tensor_parallel_size(data, world_size) > 1:
        raise ConfigError("sequence_parallel_size", "sequence parallelism does not combine "
                          "with tensor_parallel.autotp_size; use one of them", value=size)
    return size


def check_other_parallelism(raw: Mapping[str, Any]) -> None:
    """Refuse pipeline parallelism by name when it would change training: a ``pipeline``
    section with more than one stage."""
    pipeline = raw.get("pipeline")
    stages = pipeline.get("stages", 1) if isinstance(pipeline, dict) else 1
    if isinstance(stages, int) and not isinstance(stages, bool) and stages > 1:
        raise ConfigError("pipeline.stages", "pipeline parallelism is not implemented; "
                          "zerotrain combines ZeRO with tensor_parallel.autotp_size or "
                          "sequence_parallel_size only", value=stages)
