"""The walk over the user's keys before pydantic sees them, and pydantic's errors after.

Every key is checked against its section: aliases resolved, DeepSpeed-only keys dropped and
recorded, "auto" refused, unknown keys answered with a did-you-mean; pydantic's first error
becomes a ``ConfigError`` at the dotted key the user wrote (Note "why unknown keys error but
DeepSpeed-only keys warn" in ``keys.py``). What DeepSpeed itself ignores is ignored and
recorded too (Note "what DeepSpeed ignores" in ``keys.py``): "auto" inside
``zero_optimization``, and top-level keys that are dotted or far from every known key.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type, get_args

from pydantic import BaseModel, ValidationError

from ..errors import ConfigError
from .keys import _KEY_ALIASES, CLOSE_MATCH, UNIMPLEMENTED_KEYS, drops_auto, refused_when_on
from .sections import OPTIMIZER_PARAMS


@dataclass
class _Walk:
    """What the key walk learns: DeepSpeed-only keys seen, aliases used (model path -> user's)."""

    unimplemented: List[str] = field(default_factory=list)
    ignored: List[str] = field(default_factory=list)
    renamed: Dict[str, str] = field(default_factory=dict)

    def user_path(self, path: str) -> str:
        """Spell a model path the way the user did, so errors name the key in their file."""
        for canon, user in sorted(self.renamed.items(), key=lambda item: -len(item[0])):
            if path == canon or path.startswith((canon + ".", canon + "[")):
                return user + path[len(canon):]
        return path


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _section_model(annotation: Any) -> Optional[Type[BaseModel]]:
    """The model a field holds (also inside Optional[...]), or None for a plain value."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _clean(model: Type[BaseModel], data: Any, path: str, canon: str, walk: _Walk) -> Any:
    """Copy ``data`` for ``model``: check every key, reject "auto", resolve aliases, drop
    DeepSpeed-only keys. ``path`` is the user's dotted spelling, ``canon`` the model's."""
    if not isinstance(data, dict):
        return data  # the wrong type is reported by pydantic, with what was expected
    aliases = _KEY_ALIASES.get(canon, {})
    skipped = UNIMPLEMENTED_KEYS.get(canon, frozenset())
    fields = model.model_fields
    out: Dict[str, Any] = {}
    spelled: Dict[str, str] = {}  # model key -> the user's key that set it
    for key, value in data.items():
        where = _join(path, key)
        name = aliases.get(key, key) if isinstance(key, str) else key
        if (name in fields or key in skipped) and _is_auto(value) and drops_auto(canon):
            walk.ignored.append(f'{where} ("auto": DeepSpeed\'s default)')
            continue
        if name in fields:
            if name in spelled:
                raise ConfigError(where, f"sets the same option as {_join(path, spelled[name])}; "
                                         "give only one of them", value=value)
            spelled[name] = key
            sub = _section_model(fields[name].annotation)
            if sub is None or not isinstance(value, dict):
                _reject_auto(value, where)   # a section's own keys are checked one by one
            if name != key:
                walk.renamed[_join(canon, name)] = where
            out[name] = _clean(sub, value, where, _join(canon, name), walk) if sub else value
        elif key in skipped:
            _reject_auto(value, where)
            why = refused_when_on(_join(canon, key), value)
            if why:
                raise ConfigError(where, why, value=value)
            walk.unimplemented.append(where)
        elif not canon and ignored_at_top(key, [*fields, *aliases, *skipped]):
            walk.ignored.append(f"{where} (" + ("a dotted top-level key" if "." in str(key)
                                                else "an unknown top-level key") + ")")
        else:
            raise _unknown_key(key, where, list(fields), [*aliases, *skipped])
    return out


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _reject_auto(value: Any, path: str) -> None:
    """Refuse "auto" at any depth: only the Hugging Face integration knows what to fill in."""
    if isinstance(value, str) and value == "auto":
        raise ConfigError(path, '"auto" values are filled in by the Hugging Face integration; '
                                "zerotrain needs a concrete value here", value=value)
    if isinstance(value, dict):
        for key, item in value.items():
            _reject_auto(item, _join(path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _reject_auto(item, f"{path}[{index}]")


def _unknown_key(key: Any, path: str, valid: List[str], also_known: List[str]) -> ConfigError:
    close = _close_match(key, valid + also_known)
    if close:
        suggestion: Optional[str] = f"did you mean {close[0]}"
    elif len(valid) <= 12:
        suggestion = "valid keys: " + ", ".join(sorted(valid))
    else:
        suggestion = None
    return ConfigError(path, "unknown config key", value=key, suggestion=suggestion)


def _close_match(key: Any, known: List[str]) -> List[str]:
    return difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=CLOSE_MATCH)


def ignored_at_top(key: Any, known: List[str]) -> bool:
    """Whether DeepSpeed's reading of an unknown top-level ``key`` (it ignores every one) is
    followed: a dotted key, or one close to no known key. A key a did-you-mean would name
    (``zero_optimisation``) stays an error (Note "what DeepSpeed ignores" in ``keys.py``)."""
    return "." in str(key) or not _close_match(key, known)


def _choose(value: Any, choices: tuple, path: str, *, ignore_case: bool) -> Any:
    """Map ``value`` onto one of ``choices`` (canonical spelling), or explain the miss."""
    if not isinstance(value, str):
        return value  # pydantic reports the type
    for choice in choices:
        if value == choice or (ignore_case and value.lower() == choice.lower()):
            return choice
    lowered = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
    suggestion = f"did you mean {lowered[close[0]]}" if close else None
    raise ConfigError(path, f"unsupported type {value!r}; zerotrain supports "
                            + ", ".join(choices), value=value, suggestion=suggestion)


def _prepare_optimizer(data: Dict[str, Any], walk: _Walk) -> None:
    """Canonicalise ``optimizer.type`` and validate ``optimizer.params`` for that type."""
    section = data.get("optimizer")
    if not isinstance(section, dict) or "type" not in section:
        return  # missing or mistyped: pydantic reports it
    section["type"] = _choose(section["type"], tuple(OPTIMIZER_PARAMS), "optimizer.type",
                              ignore_case=True)
    params = section.get("params", {})
    model = OPTIMIZER_PARAMS.get(section["type"]) if isinstance(section["type"], str) else None
    if model is None or not isinstance(params, dict):
        return
    cleaned = _clean(model, params, "optimizer.params", "optimizer.params", walk)
    values = _validate(model, cleaned, "optimizer.params", walk).model_dump(
        exclude_unset=True, exclude_none=True)
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    section["params"] = values


def _validate(model: Type[BaseModel], data: Any, prefix: str, walk: _Walk) -> Any:
    """Run pydantic, turning its first error into a ConfigError at the dotted key."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
    path = prefix
    for part in error["loc"]:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, part)
    path = walk.user_path(path)
    if error["type"] == "missing":
        raise ConfigError(path, "required key is missing")
    value = error.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    message = error["msg"]
    if message.startswith("Input should be "):
        message = f"expected {message[len('Input should be '):]}, got {shown}"
    else:
        message = f"{message}, got {shown}"
    raise ConfigError(path, message, value=value)
