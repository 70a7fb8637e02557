"""``zerotrain.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` names.

A DeepSpeed script moves over unchanged::

    zerotrain.checkpointing.configure(None, deepspeed_config=args.deepspeed_config)
    x = zerotrain.checkpointing.checkpoint(block, x, mask)

The implementation, its settings and its Notes are in ``recompute.py``; this module only
gives them DeepSpeed's name, as ``zero/`` does for ``zero3/``.
"""
from .recompute import (checkpoint, configure, current_settings, is_configured,
                         non_reentrant_checkpoint, reset)

__all__ = ["checkpoint", "configure", "current_settings", "is_configured",
           "non_reentrant_checkpoint", "reset"]
