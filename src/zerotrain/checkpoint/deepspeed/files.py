"""Where a DeepSpeed checkpoint's files are, and reading them (through ``unpickle``).

A DeepSpeed save directory holds ``latest`` (a text file naming a tag) and one directory per
tag. Below stage 3 a tag holds ``mp_rank_00_model_states.pt``; at stage 3 every rank writes
``zero_pp_rank_<R>_mp_rank_00_model_states.pt``. The optimizer's shards are
``zero_pp_rank_<R>_mp_rank_00_optim_states.pt``, or ``bf16_zero_pp_rank_...`` when the run
was bf16. Nothing here needs DeepSpeed installed.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..fs import read_latest_text
from ..manifest import MANIFEST_NAME, CheckpointError
from .unpickle import load_file

MODEL_FILE = "mp_rank_00_model_states.pt"
_RANK_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_RANK_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_TAG_STEP = re.compile(r"^global_step(\d+)$")   # the tags DeepSpeed names by default
_OTHER_MP = re.compile(r"^(zero_pp_rank_\d+_)?mp_rank_(0[1-9]|[1-9]\d+)_model_states\.pt$")


def is_deepspeed_tag_dir(path: str) -> bool:
    """Whether ``path`` is a DeepSpeed tag directory (it holds model-states files and no
    zerotrain manifest: a zerotrain tag of stages 0-2 carries DeepSpeed's module file too)."""
    try:
        names = os.listdir(path) if os.path.isdir(path) else []
    except OSError:   # unreadable: not a tag we can load (auto-resume tries the next one)
        return False
    if MANIFEST_NAME in names:
        return False
    return any(name == MODEL_FILE or _RANK_MODEL.match(name) for name in names)


def tag_steps(path: str) -> Optional[int]:
    """N for a DeepSpeed tag directory named ``global_stepN`` (None otherwise): auto-resume
    tries these newest first, in numeric order (``global_step10`` before ``global_step9``)."""
    match = _TAG_STEP.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match and is_deepspeed_tag_dir(path) else None


def find_tag_dir(load_dir: str, tag: Optional[Any] = None, *,
                 accept_tag_dir: bool = False) -> Optional[str]:
    """The DeepSpeed tag directory ``load_dir/tag`` (``tag`` None: the one ``latest``
    names), or None when that is not a DeepSpeed checkpoint. With ``accept_tag_dir`` a
    ``load_dir`` that already is a tag directory is returned as it is."""
    if accept_tag_dir and tag is None and is_deepspeed_tag_dir(load_dir):
        return load_dir
    if tag is None:
        try:
            tag = read_latest_text(load_dir)   # bounded: never a FIFO or a huge file
        except CheckpointError:
            return None   # not a DeepSpeed checkpoint we can read; zerotrain's loader says why
        if tag is None:
            return None
    tag = str(tag)
    if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        return None
    path = os.path.join(load_dir, tag)
    return path if is_deepspeed_tag_dir(path) else None


@dataclass(frozen=True, slots=True)
class TagFiles:
    """The files of one DeepSpeed tag: model states (one, or one per rank at stage 3) and the
    optimizer shards by rank (empty when the tag was saved without them)."""

    path: str
    model_files: tuple[str, ...]
    optim_files: tuple[str, ...]


def list_files(path: str) -> TagFiles:
    """Classify the files of tag directory ``path``; CheckpointError if the set is not one
    DeepSpeed writes (model parallelism, missing or duplicate ranks)."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise CheckpointError(f"cannot list DeepSpeed checkpoint tag {path}: "
                              f"{exc.strerror or exc}") from None
    others = [n for n in names if _OTHER_MP.match(n)]
    if others:
        raise CheckpointError(f"{os.path.join(path, others[0])}: model (tensor) parallel "
                              "DeepSpeed checkpoints are not supported; zerotrain is data "
                              "parallel only")
    rank_models = _by_rank(path, [(int(m.group(1)), n) for n in names
                                  if (m := _RANK_MODEL.match(n))], "model-states")
    optim = [(int(m.group(2)), n) for n in names if (m := _RANK_OPTIM.match(n))]
    if len({bool(_RANK_OPTIM.match(n).group(1)) for _, n in optim}) > 1:
        raise CheckpointError(f"{path} holds both bf16_zero_pp_rank_* and zero_pp_rank_* "
                              "optimizer files; it mixes two runs")
    optim_files = _by_rank(path, optim, "optimizer-state")
    if rank_models:
        model_files = rank_models
    elif MODEL_FILE in names:
        model_files = (os.path.join(path, MODEL_FILE),)
    else:
        raise CheckpointError(f"{path} has no {MODEL_FILE} (nor zero_pp_rank_*_mp_rank_00_"
                              "model_states.pt): it is not a DeepSpeed checkpoint tag")
    if rank_models and optim_files and len(rank_models) != len(optim_files):
        raise CheckpointError(f"{path}: {len(rank_models)} model-states files but "
                              f"{len(optim_files)} optimizer-state files")
    return TagFiles(path, model_files, optim_files)


def _by_rank(path: str, found: list[tuple[int, str]], what: str) -> tuple[str, ...]:
    ranks = sorted(rank for rank, _ in found)
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks)) if ranks else []
        detail = f"rank {missing[0]}'s file is missing" if missing else "a rank appears twice"
        raise CheckpointError(f"{path}: the DeepSpeed {what} files are not ranks 0..N-1 "
                              f"({detail})")
    return tuple(os.path.join(path, name) for _, name in sorted(found))


def read(path: str) -> dict:
    """One DeepSpeed file's top-level dict (tensors memory-mapped)."""
    value = load_file(path)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a {type(value).__name__}, not the dict "
                              "DeepSpeed saves")
    return value
