"""Which backwards reduce: the engine's ``no_sync()`` and ``coalesce_grad_reduction()``.

Why a module of its own: the two contexts only say whether the backwards inside keep their
gradients on this rank; the engine's ``backward`` and ``step`` read that (``inside_no_sync_ctxt``,
``_local_backwards``) and refuse a step that would use one rank's gradients. Kept apart, as a
mixin :class:`~zerotrain.engine.ZeroEngine` inherits, the rules are in one place with
their Note.

Note: no_sync
    At stages 0 and 1 each rank accumulates the full gradient and one backward reduces it:
    the one that ends the accumulation window. Inside ``no_sync()`` a backward only
    accumulates, even at the boundary, and the window's next backward outside it reduces
    the whole sum; so a loop that wraps all but a window's last backward in ``no_sync`` ends
    bit for bit where it would without it. The loss is still divided by
    ``gradient_accumulation_steps`` (DeepSpeed stops dividing inside ``no_sync``). A step at
    the boundary inside ``no_sync``, or after a ``no_sync`` backward that no reducing
    backward has followed, raises StateError instead of updating with one rank's
    gradients; ``step()`` at other micro-steps only counts them. Stages 2 and 3 reduce-scatter
    every backward's gradients into shards, so there ``no_sync`` refuses, as DeepSpeed's
    does. Nesting ``no_sync`` in ``no_sync`` is allowed (leaving the inner context restores
    the outer state, as with DDP's ``no_sync``; DeepSpeed refuses re-entry); ``no_sync``
    inside ``coalesce_grad_reduction()`` and the reverse are refused, as in DeepSpeed: the
    block's exit is its one reduction, and an inner context would change which backwards
    it covers.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from ..errors import ContextMisuseError


class EngineAccumulation:
    """``no_sync()`` and ``coalesce_grad_reduction()`` (Note: no_sync)."""

    stage: Any
    pipeline_parallelism = False   # DeepSpeed's engine flag: this engine runs no pipeline
    inside_no_sync_ctxt: bool
    _coalescing: bool
    _local_backwards: int

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside keep their gradients on this rank; the accumulation window's next
        backward outside reduces them with its own (Note: no_sync). Stages 0 and 1 only."""
        if self.stage.reduces_every_micro_step:
            raise ContextMisuseError(
                f"engine.no_sync() is not supported at ZeRO stage "
                f"{self.zero_optimization_stage()}: it partitions gradients, reduce-scattering "
                "each backward's gradients into shards, so none can stay local (DeepSpeed "
                "refuses it there too); accumulate with gradient_accumulation_steps instead")
        if self._coalescing:
            raise ContextMisuseError(
                "engine.no_sync() inside coalesce_grad_reduction(): the block already keeps "
                "its backwards local and reduces them once at its exit; nesting no_sync in it "
                "is refused, as in DeepSpeed")
        outer, self.inside_no_sync_ctxt = self.inside_no_sync_ctxt, True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = outer

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """DeepSpeed 0.19's one reduction per step: the backwards inside keep their
        gradients on this rank and leaving the block reduces them once; ``step()`` comes
        after it. Stage 1 accumulates locally as under ``no_sync``; stages 2 and 3
        reduce-scatter each backward into the rank's shard sum, so there the block changes
        how many reductions run, not the mean the step applies (as DeepSpeed's flush)."""
        if self.zero_optimization_stage() == 0:
            raise NotImplementedError("coalesce_grad_reduction requires ZeRO stage 1/2/3, "
                                      "got stage 0")
        if self.pipeline_parallelism:
            raise NotImplementedError("coalesce_grad_reduction is not supported with "
                                      "pipeline parallelism")
        wrapper = _unpatchable_wrapper(getattr(self, "optimizer", None))
        if wrapper is not None:
            raise NotImplementedError(
                f"coalesce_grad_reduction does not support the optimizer wrapper {wrapper} "
                "that DeepSpeed uses for this config (ZeRO stage 1 with bf16 parameters, "
                "data_types.grad_accum_dtype \"fp32\" and no optimizer offload), as in "
                "DeepSpeed; remove data_types.grad_accum_dtype (zerotrain accumulates in fp32 "
                "by default, and DeepSpeed then uses its ZeRO optimizer, which takes the "
                "block), offload the optimizer, or use stage 2")
        if self.inside_no_sync_ctxt or self._coalescing:
            raise ContextMisuseError("coalesce_grad_reduction cannot be nested inside another no_sync "
                             "or coalesce_grad_reduction block")
        local = not self.stage.reduces_every_micro_step
        self._coalescing = True
        self.inside_no_sync_ctxt = local
        try:
            yield
        finally:
            self._coalescing = False
            self.inside_no_sync_ctxt = False
            if local and self._local_backwards:   # the flush: one reducing empty backward
                self.stage.begin_backward(True)
                self.stage.buckets.begin(True)
                self.stage.finish_backward()
                self._local_backwards = 0


def _unpatchable_wrapper(optimizer: Any) -> Optional[str]:
    """The DeepSpeed optimizer wrapper this engine's optimizer stands for when DeepSpeed's
    ``coalesce_grad_reduction`` refuses it (``BF16_Optimizer``: its own gradient path, which
    the block cannot patch), else None. zerotrain's stage 1 could run the block there; it
    refuses so that a script behaves the same on both, and loses nothing: without the
    explicit ``grad_accum_dtype`` key zerotrain accumulates in fp32 all the same."""
    kinds = getattr(optimizer, "deepspeed_kinds", ())
    return "BF16_Optimizer" if "BF16_Optimizer" in kinds else None
