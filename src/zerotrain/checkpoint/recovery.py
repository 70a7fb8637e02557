"""The recovery script a save leaves in its save directory: ``zero_to_fp32.py``.

Why: DeepSpeed copies its ``zero_to_fp32.py`` into every save directory, so whoever holds
only the folder can still get the full weights (``python zero_to_fp32.py . out``). zerotrain
writes a script of that name and usage that does the same through zerotrain's pickle-free
reader (:func:`~zerotrain.checkpoint.convert_zero_checkpoint_to_fp32_state_dict`: fp32
safetensors in the Hugging Face layout). It needs zerotrain installed where it runs.

Nothing of zerotrain ever runs or imports the script: loading reads ``latest``, the tag's
manifest and its safetensors files only. Rank 0 writes it after publishing a tag, through a
temporary file and a rename, and a failure to write it is a warning, never a failed save.
"""
from __future__ import annotations

import logging
import os
import stat
import threading

from .. import untrusted

SCRIPT_NAME = "zero_to_fp32.py"

# DeepSpeed's ``deepspeed.utils.logger`` is zerotrain's package logger, and the message
# below is its ``_change_recovery_script_permissions``'s: both log there.
_ds_logger = logging.getLogger("zerotrain")
logger = logging.getLogger(__name__)

SCRIPT = '''#!/usr/bin/env python
"""Full fp32 weights from the zerotrain checkpoint in this folder (written by zerotrain).

    python zero_to_fp32.py . output_dir [-t TAG] [--max_shard_size 5GB]

Writes safetensors shards in the Hugging Face layout into output_dir (one file when it ends
in .safetensors), read with zerotrain's pickle-free loader; the same as
`zerotrain consolidate`. Needs zerotrain installed. Loading a checkpoint never runs this.
"""
import argparse

from zerotrain.checkpoint import convert_zero_checkpoint_to_fp32_state_dict


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", help="this folder (it holds 'latest')")
    parser.add_argument("output_dir", help="a folder, or a file ending in .safetensors")
    parser.add_argument("-t", "--tag", default=None, help="the tag (default: 'latest')")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="accepted for DeepSpeed's script; the output is safetensors")
    args = parser.parse_args(argv)
    for path in convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, tag=args.tag,
            max_shard_size=args.max_shard_size):
        print(path)


if __name__ == "__main__":
    main()
'''


def change_permissions(dst: str) -> None:
    """Make ``dst`` executable; where the file system refuses (a share without permission
    bits) or the file is gone, log it at info level and go on, as DeepSpeed does."""
    try:
        os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
    except (FileNotFoundError, PermissionError) as exc:
        _ds_logger.info(f"Warning: Could not change permissions for {dst} due to error: "
                        f"{exc}. Continuing without changing permissions.")


def _current(dst: str, save_dir: str) -> bool:
    """Whether ``dst`` already holds :data:`SCRIPT` (read through the one opener: a FIFO
    planted there must not hang the save)."""
    try:
        return untrusted.read_text(dst, what="recovery script", root=save_dir,
                                   max_bytes=4 * len(SCRIPT) + 4096) == SCRIPT
    except (FileNotFoundError, untrusted.UnsafeFile):
        return False


def write_script(save_dir: str) -> None:
    """Rank 0, after publishing: ``save_dir/zero_to_fp32.py`` (replaced whole through a
    temporary file and a rename, then made executable). Failures are logged, not raised."""
    dst = os.path.join(save_dir, SCRIPT_NAME)
    tmp = f"{dst}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        if os.path.isfile(dst) and not os.path.islink(dst) and _current(dst, save_dir):
            change_permissions(dst)
            return
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(SCRIPT)
        os.replace(tmp, dst)
    except OSError as exc:
        logger.warning("could not write the recovery script %s: %s", dst, exc)
        try:
            os.remove(tmp)
        except OSError:
            pass
        return
    change_permissions(dst)
