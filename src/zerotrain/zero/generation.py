"""DeepSpeed's ``unwrap_model_for_generation``: the whole model gathered for generation.

Why: ``generate()`` runs many short forwards; at stage 3 each would gather and release every
unit through the module hooks. DeepSpeed (``runtime.zero.stage3``) gathers every parameter
once for the block and takes its forward hooks out, so the forwards run on full weights;
TRL and other generation loops call it by that name. The same here: the parameters are
gathered whole (``GatheredParameters``, no write-back) and the stage's forward hooks are set
aside, then put back in their order, so training goes on after the block as before.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..stages.zero3.zero_init import GatheredParameters


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yield ``model`` (an engine) with full parameters and no stage-3 forward hooks. Below
    stage 3 nothing is partitioned or hooked, and the block runs on the model as it is."""
    set_aside = getattr(getattr(model, "stage", None), "forward_hooks_set_aside", None)
    with GatheredParameters(list(model.parameters())):
        with set_aside() if set_aside is not None else contextlib.nullcontext():
            yield model
