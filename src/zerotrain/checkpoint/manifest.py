"""The checkpoint manifest: its fields, JSON-only values, and validation before any I/O.

Note: one manifest per tag
    ``<save_dir>/<tag>/manifest.json`` is the only place that says what a checkpoint holds.
    It names every file of the tag (plain file names inside the tag directory; anything
    else is rejected as path traversal), records each flat shard's ``FlatLayout``
    description and the parameter names and shapes it covers, and carries every small piece
    of training state as JSON. Loading validates it completely on every rank before the
    first collective, so a bad checkpoint raises the same error everywhere instead of
    leaving some ranks waiting in a collective.

The field list is in ``docs/checkpoints.md``.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
from typing import Any, Callable, Optional

from .. import untrusted
from ..errors import CheckpointError  # defined there; importable from here too

FORMAT = "zerotrain.checkpoint"
VERSION = 1
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
MANIFEST_MAX_BYTES = 256 << 20   # a manifest lists records and counters: never this large
MODULE_FILE = "module.safetensors"
COUNTERS = ("global_steps", "micro_steps", "skipped_steps", "global_samples")

_REQUIRED = {"format": str, "version": int, "tag": str, "world_size": int, "stage": int,
             "precision": str, "counters": dict, "records": list, "module_file": str,
             "frozen": list, "buffers": list, "rank_files": list, "file_sizes": dict,
             "optimizer": dict}
_RECORD_REQUIRED = {"key": str, "group_index": int, "names": list, "shapes": list,
                    "layout": dict, "shard_numel": int, "files": list,
                    "dtype": str, "state_tensors": list, "state_scalars": dict}

_ENTRY_REQUIRED = {"name": str, "key": str, "shape": list, "dtype": str}
_EXCLUDED_REQUIRED = {"name": str, "shape": list, "dtype": str}   # frozen, left out
# What reading a file whose fields have the wrong type or size raises; each format names it.
MALFORMED = (ValueError, TypeError, RuntimeError, RecursionError, KeyError, IndexError,
             AttributeError, OverflowError)


# --------------------------------------------------------------------------- JSON values
def encode_json(value: Any, path: str, other: Callable[[Any, str], Any], *,
                reserved_key: Optional[str] = None) -> Any:
    """The one JSON walk of checkpoint state (the manifest's small state and
    ``client_state``): numbers become Python ones (numpy's too), dicts must have string
    keys, lists are walked, and every other value goes to ``other(value, path)``, which
    returns its JSON form or raises. ``path`` names where a value stands, e.g.
    ``client_state['opt'][2]``, so every refusal says which key it was."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):   # numpy integers too
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{path} has the non-string key {key!r}; checkpoint "
                                      "state is JSON, whose object keys are strings")
            if key == reserved_key:
                raise CheckpointError(f"{path} uses the key {key!r}, which zerotrain "
                                      "reserves for tensors and tuples; rename it")
            out[key] = encode_json(item, f"{path}[{key!r}]", other, reserved_key=reserved_key)
        return out
    if isinstance(value, list):
        return [encode_json(item, f"{path}[{i}]", other, reserved_key=reserved_key)
                for i, item in enumerate(value)]
    return other(value, path)


def to_json(value: Any, path: str, *, tensors_as_numbers: bool = False) -> Any:
    """A JSON-able copy of ``value`` (tuples become lists), or CheckpointError naming the
    first offending key path.

    With ``tensors_as_numbers`` a tensor becomes its ``tolist()`` (for optimizer
    hyperparameters such as a tensor ``lr``); otherwise tensors are rejected.
    """
    def other(item: Any, where: str) -> Any:
        if isinstance(item, tuple):
            return encode_json(list(item), where, other)
        if tensors_as_numbers and hasattr(item, "tolist") and hasattr(item, "dtype"):
            return item.tolist()
        raise CheckpointError(f"{where} is a {type(item).__module__}."
                              f"{type(item).__qualname__}, which is not JSON (dict with str "
                              "keys, list, str, int, float, bool or None); checkpoints never "
                              "pickle, so convert it (e.g. tensor.tolist()) or save it yourself")
    return encode_json(value, path, other)


# --------------------------------------------------------------------------- names
def check_tag(tag: Any) -> str:
    """A tag is a directory name directly under the save directory."""
    if not isinstance(tag, str) or not tag or tag in (".", "..") or tag.startswith(".") \
            or "/" in tag or "\\" in tag or os.sep in tag or "\0" in tag:
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain directory name (no "
                              "path separators, not starting with '.')")
    if tag == LATEST_NAME:
        raise CheckpointError(f"checkpoint tag {tag!r} would clash with the '{LATEST_NAME}' "
                              "file")
    return tag


def safe_file(directory: str, name: Any, *, what: str) -> str:
    """``directory/name`` for a plain file name; path traversal raises CheckpointError."""
    bad = (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
           or "\\" in name or "\0" in name or os.path.basename(name) != name)
    if not bad:
        full = os.path.realpath(os.path.join(directory, name))
        bad = os.path.dirname(full) != os.path.realpath(directory)
    if bad:
        raise CheckpointError(f"{what}: file name {name!r} points outside the checkpoint "
                              f"directory {directory}; refusing to read it")
    return os.path.join(directory, name)


def check_regular_file(path: str, *, what: str, max_bytes: Optional[int] = None,
                       root: Optional[str] = None) -> int:
    """``untrusted.check_regular_file`` raising CheckpointError (a missing file too)."""
    try:
        return untrusted.check_regular_file(path, what=what, max_bytes=max_bytes, root=root)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except untrusted.UnsafeFile as exc:
        raise CheckpointError(str(exc)) from None


def read_regular_file(path: str, *, what: str, max_bytes: int,
                      root: Optional[str] = None) -> bytes:
    """``untrusted.read_regular_file`` raising CheckpointError (FileNotFoundError when the
    file is missing, for callers to whom that is normal)."""
    try:
        return untrusted.read_regular_file(path, what=what, max_bytes=max_bytes, root=root)
    except untrusted.UnsafeFile as exc:
        raise CheckpointError(str(exc)) from None


def save_identity(text: str) -> int:
    """A 62-bit hash of a save's identity, for the load's agreement."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


# --------------------------------------------------------------------------- validation
def read_manifest(tag_dir: str) -> dict:
    """Parse and validate ``tag_dir/manifest.json`` (no tensor is read)."""
    path = os.path.join(tag_dir, MANIFEST_NAME)
    try:
        manifest = json.loads(read_regular_file(path, what="manifest", root=tag_dir,
                                                max_bytes=MANIFEST_MAX_BYTES))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {tag_dir} is not a complete zerotrain "
                              "checkpoint") from None
    except (OSError, ValueError, RecursionError) as exc:   # deep nesting, 5000-digit numbers
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    validate(manifest, tag_dir)
    return manifest


def validate(manifest: Any, tag_dir: str) -> None:
    """Check the manifest's structure and that every file it names is a plain file name in
    ``tag_dir`` that exists with the recorded size."""
    where = os.path.join(tag_dir, MANIFEST_NAME)
    _check_fields(manifest, _REQUIRED, where)
    if manifest["format"] != FORMAT or manifest["version"] != VERSION:
        raise CheckpointError(f"{where}: format {manifest['format']!r} version "
                              f"{manifest['version']!r} is not {FORMAT!r} version {VERSION}")
    if not isinstance(manifest.get("save_id", ""), str):
        raise CheckpointError(f"{where}: field 'save_id' should be str, got "
                              f"{type(manifest['save_id']).__name__}")
    for key in COUNTERS:
        if not _is_count(manifest["counters"].get(key)):
            raise CheckpointError(f"{where}: counters.{key} is missing or not a count")
    if len(manifest["rank_files"]) != manifest["world_size"]:
        raise CheckpointError(f"{where}: {len(manifest['rank_files'])} rank files for world "
                              f"size {manifest['world_size']}")
    for i, record in enumerate(manifest["records"]):
        _check_fields(record, _RECORD_REQUIRED, f"{where} records[{i}]")
        _check_record(record, f"{where} records[{i}]")
    for kind in ("frozen", "buffers"):
        for i, entry in enumerate(manifest[kind]):
            _check_fields(entry, _ENTRY_REQUIRED, f"{where} {kind}[{i}]")
            _check_shape(entry["shape"], f"{where} {kind}[{i}]")
    excluded = manifest.get("excluded_frozen", [])   # absent in saves before the argument
    if not isinstance(excluded, list):
        raise CheckpointError(f"{where}: field 'excluded_frozen' should be list, got "
                              f"{type(excluded).__name__}")
    for i, entry in enumerate(excluded):
        _check_fields(entry, _EXCLUDED_REQUIRED, f"{where} excluded_frozen[{i}]")
        _check_shape(entry["shape"], f"{where} excluded_frozen[{i}]")
    named = [manifest["module_file"], *manifest["rank_files"]]
    named += [name for record in manifest["records"] for name in record["files"]]
    for name in named:
        safe_file(tag_dir, name, what=where)
        if name not in manifest["file_sizes"]:
            raise CheckpointError(f"{where}: no recorded size for file {name!r}")
    for name, size in manifest["file_sizes"].items():
        path = safe_file(tag_dir, name, what=where)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        found = os.path.getsize(path)
        if found != size:
            raise CheckpointError(f"checkpoint file {path} is truncated or corrupted: "
                                  f"{found} bytes, the manifest recorded {size}")


def file_identity_check(manifest: dict, tag_dir: str) -> Callable[[str, dict], None]:
    """A check for each file a load opens (``Reader(on_open=...)``): a rank file must be the
    one its name says (its ``rank`` metadata), and every file must come from the save that
    wrote the manifest (its ``save`` metadata equals the manifest's ``save_id``). So a file
    copied in from another rank or another checkpoint, which can have the recorded size,
    is refused by name instead of loading the wrong shards. Checkpoints written before
    ``save_id`` existed are checked for the rank only."""
    rank_of = {name: str(r) for r, name in enumerate(manifest["rank_files"])}
    save_id = manifest.get("save_id")

    def check(filename: str, metadata: dict) -> None:
        path = os.path.join(tag_dir, filename)
        rank = metadata.get("rank")
        if filename in rank_of and rank is not None and rank != rank_of[filename]:
            raise CheckpointError(f"checkpoint file {path} holds rank {rank}'s shards, not "
                                  f"rank {rank_of[filename]}'s: was it copied or renamed?")
        if save_id is not None and metadata.get("save") != save_id:
            raise CheckpointError(f"checkpoint file {path} was not written by the save that "
                                  f"wrote {os.path.join(tag_dir, MANIFEST_NAME)} (save "
                                  f"{metadata.get('save')!r}, manifest {save_id!r}): it "
                                  "comes from another checkpoint")
    return check


def _check_fields(obj: Any, required: dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key, kind in required.items():
        if key not in obj:
            raise CheckpointError(f"{where}: field {key!r} is missing")
        if not isinstance(obj[key], kind) or (kind is int and isinstance(obj[key], bool)):
            raise CheckpointError(f"{where}: field {key!r} should be {kind.__name__}, got "
                                  f"{type(obj[key]).__name__}")


MAX_COUNT = 2 ** 62   # steps, samples, sizes: beyond any real run (2**62: "no limit")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _check_shape(shape: Any, where: str) -> None:
    if not isinstance(shape, list) or not all(_is_count(size) for size in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of sizes")


def _check_record(record: dict, where: str) -> None:
    layout = record["layout"]
    world, numels = layout.get("world"), layout.get("numels")
    if not _is_count(world) or world < 1 or not isinstance(numels, list) \
            or not all(_is_count(n) for n in numels) \
            or not _is_count(layout.get("bucket_numel")) or layout["bucket_numel"] < 1:
        raise CheckpointError(f"{where}: layout {layout!r} is not a FlatLayout description")
    if len(record["names"]) != len(numels) or len(record["shapes"]) != len(numels):
        raise CheckpointError(f"{where}: names, shapes and layout numels differ in length")
    for name, shape, numel in zip(record["names"], record["shapes"], numels):
        _check_shape(shape, f"{where} parameter {name!r}")
        if not isinstance(name, str) or math.prod(shape) != numel:
            raise CheckpointError(f"{where}: parameter {name!r} has shape {shape} but "
                                  f"{numel} elements in the layout")
    if len(record["files"]) != world:
        raise CheckpointError(f"{where}: layout world {world} but {len(record['files'])} "
                              "shard files")
    _check_state_spec(record, where)
    if record["dtype"] != "F32":
        raise CheckpointError(f"{where}: master weights have dtype {record['dtype']}; "
                              "zerotrain checkpoints hold fp32 (F32) masters")


def _check_state_spec(record: dict, where: str) -> None:
    """``state_tensors`` are key names; each ``state_scalars`` entry is ``{"dtype": name,
    "value": v}`` with a finite number for a tensor dtype (any JSON value for "python")."""
    if not all(isinstance(key, str) for key in record["state_tensors"]):
        raise CheckpointError(f"{where}: state_tensors {record['state_tensors']!r} is not a "
                              "list of names")
    for key, spec in record["state_scalars"].items():
        if not isinstance(spec, dict) or not isinstance(spec.get("dtype"), str) \
                or "value" not in spec:
            raise CheckpointError(f"{where}: state_scalars[{key!r}] is {spec!r}; expected "
                                  "{'dtype': ..., 'value': ...}")
        if spec["dtype"] != "python" and not _finite_number(spec["value"]):
            raise CheckpointError(f"{where}: state_scalars[{key!r}] value "
                                  f"{str(spec['value'])[:40]!r} is not a finite number")


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:   # an integer too large for a float
        return False
