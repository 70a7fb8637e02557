"""transformers' lockstep flag for ``generate()`` on a stage-3 model (set while an engine holds it)."""
from __future__ import annotations

from torch import nn


# transformers runs ``generate()`` (and LayerDrop) in lockstep across ranks, an all-reduce
# deciding when every rank is done (``synced_gpus``), for modules it sees as sharded: those
# carrying FSDP2's attribute. Without it, a rank whose sequences end first leaves the loop
# and its peers' remaining gathers pair with whatever collective it calls next.
_LOCKSTEP_FLAG = "_is_fsdp_managed_module"


def mark_lockstep(module: nn.Module, on: bool) -> None:
    """Set (or remove) transformers' "sharded: run generate() in lockstep" flag on each
    module that has a ``generate`` method (``module`` or an inner model). Only there:
    torch.compile treats a module carrying the flag as FSDP's, and stage 3 compiles blocks,
    which never have ``generate``."""
    for m in module.modules():
        if not callable(getattr(type(m), "generate", None)):
            continue
        if on:
            m.__dict__[_LOCKSTEP_FLAG] = True
        else:
            m.__dict__.pop(_LOCKSTEP_FLAG, None)
