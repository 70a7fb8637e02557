"""Where an export writes: never into its source, never in place.

Note: exports write like saves
    An export (``zerotrain consolidate`` to Hugging Face, torch DCP or DeepSpeed) reads one
    checkpoint and writes another. Its output may not be the tag folder it reads, lie inside
    it or contain it (compared after resolving symlinks; :func:`check_apart`), so an export
    can never write over what it reads: ``consolidate ckpt ckpt`` is refused (``ckpt``
    holds the tag), while an output beside the tag in the save directory
    (``python zero_to_fp32.py . out``, DeepSpeed's documented use, which the recovery script
    keeps) is not. Its files are written into a temporary folder beside the target
    (``.tmp-<name>-<nonce>``), fsynced, and moved in by the save's own publication
    (``fs.publish``: an existing target moved aside, the new one renamed in, the old one
    deleted, the directory fsynced), so a failed or killed export leaves the earlier output
    as it was, and a finished one holds nothing of an earlier one:

    * a folder output (Hugging Face shards, a DCP folder) is replaced whole; a folder that
      holds a file this kind of export does not write is refused, naming the file (it is
      not the export's to delete);
    * one ``.safetensors`` file: a temporary file beside it, fsynced, ``os.replace``d;
    * a DeepSpeed save directory: the tag is published into it as a save publishes one
      (under the save lock, after tidying what interrupted saves left) and ``latest``
      rewritten; the directory's other tags stay as they are.

    Leftovers of a killed export are ``.tmp-<name>-<nonce>`` (deleted by the next export
    to the same target) and, killed between the two renames, ``.old-<name>-<nonce>`` (put
    back by the next export when the target is missing).
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from typing import Callable, Iterator

from . import fs
from .manifest import CheckpointError
from .stfile import fsync_path


def check_apart(source: str, output: str) -> None:
    """Refuse an output that is ``source`` (the tag folder an export reads), lies inside it,
    or contains it (symlinks resolved): writing it would replace or mix with the checkpoint
    being read."""
    src, out = os.path.realpath(source), os.path.realpath(output)
    if src == out:
        raise CheckpointError(f"the output {output} is the checkpoint {source} itself; "
                              "write the export to another folder")
    if _inside(out, src):
        raise CheckpointError(f"the output {output} is inside the checkpoint {source}; "
                              "write the export outside it")
    if _inside(src, out):
        raise CheckpointError(f"the checkpoint {source} is inside the output {output}; "
                              "write the export to a folder that does not contain it")


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip(os.sep) + os.sep)


def fsync_tree(folder: str) -> None:
    """Flush every file under ``folder`` and every directory (torch.save and json do not)."""
    for root, _, files in os.walk(folder):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


@contextmanager
def replacing_folder(source: str, output: str, owned: Callable[[str], bool],
                     what: str) -> Iterator[str]:
    """Yield an empty temporary folder beside ``output``; once the body returns, it replaces
    ``output`` whole (Note: exports write like saves). ``owned(name)``: whether a file
    of that name in an existing ``output`` is one this ``what`` export writes."""
    check_apart(source, output)
    target = os.path.realpath(output)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise CheckpointError(f"the output {output} exists and is not a folder")
    if os.path.isdir(target):
        foreign = sorted(n for n in os.listdir(target) if not owned(n))
        if foreign:
            raise CheckpointError(f"the output {output} holds {foreign[0]!r}, which a {what} "
                                  "export does not write; it replaces the folder whole, so "
                                  "give it a new or empty folder (or one an earlier export "
                                  "wrote)")
    parent, name = os.path.split(target)
    with _locked(parent, output):
        _tidy(parent, name)
        nonce = fs.new_nonce()
        tmp = fs.temp_dir(parent, name, nonce)
        with _published(tmp):
            os.makedirs(tmp)
            yield tmp
            fsync_tree(tmp)
            fs.publish(parent, tmp, name, nonce, save_latest=False)


@contextmanager
def replacing_file(source: str, output: str) -> Iterator[str]:
    """Yield a temporary file name beside ``output``; once the body has written it, it is
    fsynced and renamed over ``output``."""
    check_apart(source, output)
    target = os.path.realpath(output)
    if os.path.isdir(target):
        raise CheckpointError(f"the output {output} is a folder; a name ending in "
                              ".safetensors is written as one file")
    parent, name = os.path.split(target)
    with _locked(parent, output):
        _tidy(parent, name)
        tmp = fs.temp_dir(parent, name, fs.new_nonce())
        with _published(tmp):
            yield tmp
            fsync_path(tmp)
            os.replace(tmp, target)
            fsync_path(parent)


@contextmanager
def publishing_tag(source: str, save_dir: str, tag: str) -> Iterator[str]:
    """Yield the temporary folder of tag ``tag`` in save directory ``save_dir``; once the
    body returns, the tag is published there as a save publishes one (an existing tag of
    that name replaced whole, ``latest`` pointed at it, other tags left alone)."""
    check_apart(source, save_dir)
    fs.require_dir(save_dir)
    nonce = fs.new_nonce()
    try:
        tmp = fs.prepare(save_dir, tag, nonce)
    except OSError as exc:
        fs.unlock(save_dir)
        raise CheckpointError(f"cannot write into {save_dir}: {exc.strerror or exc}") from None
    try:
        with _published(tmp):
            yield tmp
            fsync_tree(tmp)
            fs.publish(save_dir, tmp, tag, nonce, save_latest=True)
    finally:
        fs.unlock(save_dir)


@contextmanager
def _locked(parent: str, output: str) -> Iterator[None]:
    """Hold the save lock of the folder the output is renamed in (one writer at a time)."""
    try:
        os.makedirs(parent, exist_ok=True)
        fs.lock(parent)
    except OSError as exc:
        raise CheckpointError(f"cannot write beside {output}: {exc.strerror or exc}") from None
    try:
        yield
    finally:
        fs.unlock(parent)


@contextmanager
def _published(tmp: str) -> Iterator[None]:
    """Delete ``tmp`` if the export fails before publishing it; name OS errors."""
    try:
        yield
    except OSError as exc:
        fs.remove_quietly(tmp)
        raise CheckpointError(f"cannot write {exc.filename or tmp}: "
                              f"{exc.strerror or exc}") from None
    except BaseException:
        fs.remove_quietly(tmp)
        raise


def _tidy(parent: str, name: str) -> None:
    """What a killed export to ``parent/name`` left: its temp folders are deleted, and an
    ``.old-`` copy is put back when the target is missing (else deleted)."""
    pattern = re.compile(r"\.(tmp|old)-" + re.escape(name) + r"-[0-9a-f]{12}")
    for entry in sorted(os.listdir(parent)):
        match = pattern.fullmatch(entry)
        if match is None:
            continue
        path = os.path.join(parent, entry)
        if match.group(1) == "old" and not os.path.lexists(os.path.join(parent, name)):
            os.rename(path, os.path.join(parent, name))
        else:
            fs.remove_quietly(path)
