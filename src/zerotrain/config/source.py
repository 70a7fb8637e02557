"""The user's config, from a dict or a JSON file, as a private dict: nothing validated yet.

Separate from the walk because it is about bytes and nesting, not keys: what a file may hold
(one JSON object, no repeated key, bounded depth) before any key is looked at.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, List, Mapping

from ..errors import ConfigError
from ..untrusted import UnsafeFile, read_regular_file

MAX_BYTES = 64 << 20   # a DeepSpeed config is a few KB


def _read(config: Any) -> Dict[str, Any]:
    """Return a private deep copy of the config as a dict, reading JSON files."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        _check_depth(config, "the config")
        return copy.deepcopy(dict(config))
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError("", "config must be a dict, a path to a JSON file, or None; "
                              f"got {type(config).__name__}")
    path = os.fspath(config)
    try:   # a regular file of bounded size: never a FIFO or /dev/zero
        text = read_regular_file(path, what="config file", max_bytes=MAX_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist") from None
    except UnsafeFile as exc:
        raise ConfigError("", str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("", f"cannot read config file {path}: {exc}") from None
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _no_duplicates(pairs, path))
    except json.JSONDecodeError as exc:
        raise ConfigError("", f"config file {path} is not valid JSON: {exc.msg} "
                              f"(line {exc.lineno}, column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:   # a 5000-digit number, deep nesting
        raise ConfigError("", f"config file {path} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"config file {path} must hold a JSON object, "
                              f"not {type(data).__name__}")
    _check_depth(data, f"config file {path}")
    return data


MAX_DEPTH = 64   # far deeper than any DeepSpeed config; deeper would hit Python's recursion


def _check_depth(config: Any, what: str) -> None:
    """ConfigError when dicts and lists nest deeper than MAX_DEPTH (checked without
    recursion, so that the check itself cannot overflow)."""
    stack = [(config, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError("", f"{what} nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)


def _no_duplicates(pairs: List[Any], path: str) -> Dict[str, Any]:
    """Refuse repeated keys: JSON keeps the last one, silently dropping the other setting."""
    result: Dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ConfigError("", f"config file {path} sets key {key!r} twice in one object")
        result[key] = value
    return result
