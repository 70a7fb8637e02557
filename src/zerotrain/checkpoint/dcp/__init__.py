"""torch Distributed Checkpoint (DCP), the format of FSDP2 and torchtitan, both ways.

``export`` writes a zerotrain checkpoint as a DCP folder (``zerotrain consolidate ... --to
dcp``); ``source`` reads one written by FSDP2 for ``engine.load_checkpoint`` (through the
DeepSpeed importer's stage/agree/commit, at any stage and world size); ``metadata`` reads
DCP's pickled ``.metadata`` with the restricted unpickler of ``checkpoint/restricted.py``.
"""
from __future__ import annotations

from .export import export_dcp
from .source import DcpCheckpoint, is_dcp_dir

__all__ = ["DcpCheckpoint", "export_dcp", "find_dcp_dir", "is_dcp_dir"]


def find_dcp_dir(load_dir: str, tag=None):
    """``load_dir`` (or ``load_dir/tag``) when it is a DCP checkpoint folder, else None."""
    import os
    path = load_dir if tag is None else os.path.join(load_dir, str(tag))
    return path if is_dcp_dir(path) else None
