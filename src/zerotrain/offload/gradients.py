"""The gradients an update receives, and their way down to the host.

Note: one arithmetic
    Every update turns record k's reduced shard into the optimizer's gradient the same way,
    wherever it runs: ``fp32(shard) / world * coef`` (``coef`` unscales the fp16 loss scale
    and clips), one IEEE division and one multiplication per element, each skipped when
    its factor is 1. Both updates do it on the device: the device update in place when the
    shard is fp32, the host update out of place before the copy down (Note "the host does
    only Adam" in transfers.py), so an offloaded step sees the very gradient the device
    would, and the host never widens or rescales one.

Note: streaming gradients down
    A record's gradient is final as soon as its last bucket is reduced in the boundary
    micro-step. The stage then calls :meth:`HostGradients.fetch` with the world size and the
    factor the step is expected to use (``1 / loss scale``: no clipping), which finishes the
    gradient on the device and starts its copy into a pinned fp32 host buffer of the
    record's own on the device-to-host stream, so the copies run during the rest of
    backward. At the step, :meth:`HostGradients.take` waits for record k's copy only; when
    the step's factor differs (clipping applies, the loss scale changed), it finishes and
    copies record k again from the shard, which stays on the device until the step ends.
    Records not fetched early (stage 1 without ``overlap_comm``, whose reductions wait for
    the step; with the delayed update, records the running update had not reached) and
    records fetched for a step that then clipped are fetched during the step, one record
    ahead of the one being stepped, so the device holds at most two finished fp32 copies at
    a time. The host buffers hold 4 bytes per element of the shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .traffic import nbytes
from .transfers import Transfers


@dataclass(frozen=True, slots=True)
class Gradients:
    """Per record: ``shards[k]`` summed over ranks (on the device, any float dtype) and
    ``wire[k]``, the narrowest dtype holding it exactly; ``world`` and ``coef`` finish it
    (Note: one arithmetic); ``unscale`` is ``coef`` without clipping (1 / loss scale)."""

    shards: list[torch.Tensor]
    wire: list[torch.dtype]
    world: int
    coef: float
    unscale: float = 1.0

    def finish(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (fp32, this record's values) averaged, unscaled and clipped, in place."""
        return finish(grad, self.world, self.coef, in_place=True)

    def on_device(self, k: int) -> torch.Tensor:
        """Record k's finished fp32 gradient where the shard is (converted in place when
        the shard is fp32, as the update consumes it)."""
        shard = self.shards[k]
        return self.finish(shard if shard.dtype == torch.float32 else shard.float())


def as_grad_of(master: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` (a finished fp32 gradient) as ``master``'s own gradient: its shape, and its
    dtype, rounded once to bf16 where the masters are bf16 (``bf16_master_weights_and_grads``:
    the optimizer steps bf16 masters with bf16 gradients, as DeepSpeed's does)."""
    grad = grad.view(master.shape)
    return grad if grad.dtype == master.dtype else grad.to(master.dtype)


def finish(shard: torch.Tensor, world: int, coef: float, *, in_place: bool) -> torch.Tensor:
    """``fp32(shard) / world * coef`` (Note: one arithmetic); out of place unless asked
    (the result may then be ``shard`` itself when nothing is to be done)."""
    grad = shard if shard.dtype == torch.float32 else shard.float()
    fresh = grad is not shard or in_place
    if world > 1:
        grad = grad.div_(world) if fresh else grad.div(world)
        fresh = True
    if coef != 1.0:
        grad = grad.mul_(coef) if fresh else grad.mul(coef)
    return grad


@dataclass(slots=True)
class _Landing:
    """Record k's copy on its way down: what to wait on and how it was finished."""

    event: Optional["torch.cuda.Event"]
    world: int
    coef: float


class HostGradients:
    """Pinned fp32 host copies of each record's finished gradient (Note: streaming
    gradients down)."""

    def __init__(self, transfers: Transfers, make_buffer: Callable[..., torch.Tensor]) -> None:
        self.transfers = transfers
        self._make_buffer = make_buffer               # storage.staging: pinned when possible
        self._buffers: dict[int, torch.Tensor] = {}   # record -> fp32 host buffer
        self._landed: dict[int, _Landing] = {}

    def fetch(self, k: int, shard: torch.Tensor, world: int, coef: float) -> None:
        """Finish record k's reduced shard on the device and start its copy down."""
        buffer = self._buffers.get(k)
        if buffer is None or buffer.numel() != shard.numel():
            buffer = self._buffers[k] = self._make_buffer(shard.numel(), torch.float32)
        grad = finish(shard, world, coef, in_place=False)
        self.transfers.host.record("gradient_land", written=nbytes(buffer))
        self._landed[k] = _Landing(self.transfers.to_host(buffer, grad), world, coef)

    def fetched(self, k: int) -> bool:
        return k in self._landed

    def forget(self) -> None:
        """Drop copies not consumed (a skipped step); the next window fetches afresh."""
        self._landed.clear()

    def ready(self, k: int, world: int, coef: float) -> bool:
        """Whether record k's copy is on its way, finished with ``world`` and ``coef``."""
        landing = self._landed.get(k)
        return landing is not None and landing.world == world and landing.coef == coef

    def forget_one(self, k: int) -> None:
        """Record k's copy was used already (a speculative step that stands)."""
        self._landed.pop(k, None)

    def wait(self, k: int) -> tuple[torch.Tensor, float, int]:
        """Record k's landed buffer and the ``coef`` and ``world`` it was finished with
        (waits for its copy only); the record must have been fetched."""
        landing = self._landed[k]
        if landing.event is not None:
            landing.event.synchronize()
            landing.event = None
        return self._buffers[k], landing.coef, landing.world

    def take(self, k: int, grads: Gradients) -> torch.Tensor:
        """Record k's finished fp32 gradient on the host, as ``grads`` finishes it: the copy
        streamed during backward when it was finished the same way, else a fresh one."""
        landing = self._landed.get(k)
        if landing is None or landing.coef != grads.coef or landing.world != grads.world:
            self.fetch(k, grads.shards[k], grads.world, grads.coef)
        buffer, _, _ = self.wait(k)
        del self._landed[k]
        return buffer

    def tensors(self) -> list[torch.Tensor]:
        return list(self._buffers.values())
