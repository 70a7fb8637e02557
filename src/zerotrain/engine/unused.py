"""``zero_optimization.ignore_unused_parameters: false``: a trained parameter that got no
gradient in an accumulation window is an error, on every rank at the same step.

Why it is opt-in and agreed: a parameter the loss never reached usually means a branch
of the model that did not run, which DeepSpeed reports at stages 1-2 when asked. Ranks
may differ (a branch taken on one rank only), so each rank counts its own and one
one-element all-reduce (only when the key is false) lets every rank raise together
rather than one rank raising while the others wait in the update's collectives.
"""
from __future__ import annotations

import torch

from ..comm import Communicator
from ..errors import UnusedParameterError


def refuse_unused_parameters(names: list[str], comm: Communicator, step: int) -> None:
    """Raise :class:`UnusedParameterError` on every rank if any rank's stage has a trained
    parameter without a gradient since the last update (``names``: this rank's, from the
    stage's ``unused_parameters()``; collective)."""
    count = torch.tensor([float(len(names))], device=comm.device)
    comm.all_reduce(count, op="max", label="unused-parameter check")
    if count.item() == 0:
        return
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more"
                                                     if len(names) > 3 else "")
    here = (f"on rank {comm.rank}: {shown}" if names else
            f"not on rank {comm.rank}, on another rank")
    raise UnusedParameterError(
        f"step {step}: trainable parameters got no gradient in this accumulation window "
        f"({here}); with zero_optimization.ignore_unused_parameters false that is an error "
        "(no update was made and the window's gradients were dropped). Set "
        "ignore_unused_parameters true, freeze those parameters (requires_grad_(False)), "
        "or make every trainable parameter take part in the loss")
