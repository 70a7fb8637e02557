"""DeepSpeed ZeRO checkpoints, read without DeepSpeed and without running their pickles.

``checkpoint.load_checkpoint`` and ``consolidate`` hand a directory here when
:func:`find_tag_dir` recognises it. Modules: ``unpickle`` (the restricted unpickler),
``files`` (which files a tag holds), ``layout`` (where each parameter's elements are),
``source`` (a tag as parameters and small state; ``source_checks``: its files'
structure), ``load`` (a tag, a Universal or a DCP folder as the load sequence's source),
``export`` (full fp32 tensors, one at a time). See ``docs/from-deepspeed.md``.
"""
from __future__ import annotations

from .export import DeepSpeedExport
from .files import find_tag_dir, is_deepspeed_tag_dir, tag_steps
from .load import ForeignSource, load_foreign
from .source import DeepSpeedCheckpoint
from .unpickle import DeepSpeedRecord, load_file

__all__ = ["DeepSpeedCheckpoint", "DeepSpeedExport", "DeepSpeedRecord", "ForeignSource",
           "find_tag_dir", "is_deepspeed_tag_dir", "load_file", "load_foreign", "tag_steps"]
