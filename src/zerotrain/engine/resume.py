"""Auto-resume: continue from the newest checkpoint that loads.

Why a module of its own: ``checkpoint.auto_resume`` (or ``zerotrain launch --auto-resume``)
turns a restarted job into a resumed one; choosing the tag, skipping the ones that do not
load, and refusing to start over from step 0 over existing checkpoints is one job, done once
by ``initialize`` after the engine is built.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional

from ..checkpoint import CheckpointError
from ..checkpoint.deepspeed import is_deepspeed_tag_dir, tag_steps
from ..checkpoint.fs import resume_candidates
from ..config import ZeroTrainConfig
from ..errors import ConfigError

if TYPE_CHECKING:
    from .engine import ZeroEngine

logger = logging.getLogger(__name__)

AUTO_RESUME_ENV = "ZEROTRAIN_AUTO_RESUME"  # set by `zerotrain launch --auto-resume DIR`
AUTO_RESUME_LAUNCHER_ENV = "ZEROTRAIN_AUTO_RESUME_LAUNCHER"   # the launcher's pid


def launched_auto_resume() -> Optional[str]:
    """``ZEROTRAIN_AUTO_RESUME`` when it is meant for this process: set by hand (no
    launcher pid beside it), or by ``zerotrain launch`` whose direct child (a torchrun
    worker) this is. A job the training script starts inherits the variables but has
    another parent, so it does not resume from the script's checkpoints."""
    directory = os.environ.get(AUTO_RESUME_ENV)
    launcher = os.environ.get(AUTO_RESUME_LAUNCHER_ENV)
    if directory and launcher is not None and launcher != str(os.getppid()):
        return None
    return directory


def auto_resume(engine: "ZeroEngine", cfg: ZeroTrainConfig) -> None:
    """Load the newest checkpoint of ``checkpoint.auto_resume`` that loads.

    The tag ``latest`` names is tried first, then the other complete tags, newest first
    (``checkpoint.fs.resume_candidates``): zerotrain's by their manifest's step count,
    DeepSpeed's ``global_stepN`` by N. Each tag skipped is named in a warning. With
    checkpoints present and none loadable it raises rather than start over from step 0
    (and later overwrite them)."""
    directory = cfg.checkpoint.auto_resume or launched_auto_resume()
    if directory and is_deepspeed_tag_dir(directory):   # global_stepN/ itself: say so
        raise ConfigError("checkpoint.auto_resume", f"{directory} is one tag of a DeepSpeed "
                          "checkpoint; give the save directory that holds it and its "
                          f"'latest' file ({os.path.dirname(os.path.abspath(directory))})")
    if not directory or not os.path.isdir(directory):
        return
    candidates, notes = resume_candidates(directory, other_steps=tag_steps)
    for tag in candidates:   # a failed load changes nothing, so the next one can be tried
        try:
            path, _ = engine.load_checkpoint(directory, tag=tag)
        except CheckpointError as exc:
            notes.append(f"{tag}: {exc}")
            continue
        for note in notes:
            logger.warning("auto-resume: skipped %s", note)
        logger.info("auto-resume: continued from %s at step %d", path, engine.global_steps)
        return
    if candidates:
        raise CheckpointError(f"auto-resume: {directory} holds checkpoints but none of them "
                              f"loads, so training does not start over: {'; '.join(notes)}")
