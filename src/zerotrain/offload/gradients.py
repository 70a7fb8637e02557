"""The gradients an update receives, and their way down to the host.

Note: one arithmetic
    Every update turns record k's reduced shard into the optimizer's gradient the same way,
    wherever it runs: ``fp32(shard) / world * coef`` (``coef`` unscales the fp16 loss scale
    and clips), one IEEE division and one multiplication per element. On the device the
    shard is converted in place when it is fp32; on the host it arrives in its exact
    dtype (``Gradients.wire``) and is converted there. Division and multiplication round
    the same on both, so an offloaded step sees the very gradient the device would.

Note: streaming gradients down
    A record's gradient is final as soon as its last bucket is reduced in the boundary
    micro-step. The stage then calls :meth:`HostGradients.fetch`, which starts the copy to
    a pinned host buffer of the record's own on the device-to-host stream, so the copies
    run during the rest of backward; the host step later waits for record k's copy only.
    Records not fetched early (stage 1 without ``overlap_comm``, whose reductions wait for
    the step; the delayed update, whose worker may still read the buffers then) are
    fetched when the step starts. The buffers hold the gradient shard in its wire dtype (2
    bytes per element of the shard for bf16 gradients reduced in bf16), plus one fp32
    buffer of the largest record for the conversion.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .transfers import Transfers


@dataclass(frozen=True, slots=True)
class Gradients:
    """Per record: ``shards[k]`` summed over ranks (on the device, any float dtype) and
    ``wire[k]``, the narrowest dtype holding it exactly; ``world`` and ``coef`` finish it
    (Note: one arithmetic)."""

    shards: list[torch.Tensor]
    wire: list[torch.dtype]
    world: int
    coef: float

    def finish(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (fp32, this record's values) averaged, unscaled and clipped, in place."""
        if self.world > 1:
            grad.div_(self.world)
        if self.coef != 1.0:
            grad.mul_(self.coef)
        return grad

    def on_device(self, k: int) -> torch.Tensor:
        """Record k's finished fp32 gradient where the shard is (converted in place when
        the shard is fp32, as the update consumes it)."""
        shard = self.shards[k]
        return self.finish(shard if shard.dtype == torch.float32 else shard.float())


class HostGradients:
    """Pinned host copies of each record's gradient (Note: streaming gradients down)."""

    def __init__(self, transfers: Transfers, make_buffer: Callable[..., torch.Tensor]) -> None:
        self.transfers = transfers
        self._make_buffer = make_buffer               # storage.staging: pinned when possible
        self._buffers: dict[int, torch.Tensor] = {}   # record -> wire-dtype host buffer
        self._landed: dict[int, Optional["torch.cuda.Event"]] = {}   # record -> copy event
        self._fp32: Optional[torch.Tensor] = None

    def fetch(self, k: int, shard: torch.Tensor, wire: torch.dtype) -> None:
        """Start copying record k's reduced shard to the host in ``wire`` (exact)."""
        buffer = self._buffers.get(k)
        if buffer is None or buffer.dtype != wire or buffer.numel() != shard.numel():
            buffer = self._buffers[k] = self._make_buffer(shard.numel(), wire)
        source = shard if shard.dtype == wire else shard.to(wire)   # exact: Note above
        self._landed[k] = self.transfers.to_host(buffer, source)

    def fetched(self, k: int) -> bool:
        return k in self._landed

    def forget(self) -> None:
        """Drop copies not consumed (a skipped step); the next window fetches afresh."""
        self._landed.clear()

    def take(self, k: int, grads: Gradients) -> torch.Tensor:
        """Record k's finished fp32 gradient on the host; waits for its copy only. The
        result is valid until the next ``take``."""
        if k not in self._landed:
            self.fetch(k, grads.shards[k], grads.wire[k])
        event = self._landed.pop(k)
        if event is not None:
            event.synchronize()
        buffer = self._buffers[k]
        if buffer.dtype == torch.float32:
            return grads.finish(buffer)
        if self._fp32 is None or self._fp32.numel() < buffer.numel():
            self._fp32 = torch.empty(buffer.numel(), dtype=torch.float32)
        grad = self._fp32[: buffer.numel()]
        grad.copy_(buffer)
        return grads.finish(grad)

    def tensors(self) -> list[torch.Tensor]:
        held = list(self._buffers.values())
        return held + ([self._fp32] if self._fp32 is not None else [])
