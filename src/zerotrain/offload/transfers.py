"""Copies between the host and the training device: on side streams, and counted.

Note: copy streams
    Host-to-device copies (16-bit parameters after the host step, stage-3 shards kept on the
    host) run on their own CUDA stream, so they overlap the compute stream instead of
    queueing behind it; device-to-host gradient copies run on another. Each side stream
    first waits for the work already queued on the compute stream (the memory a new tensor
    takes may have been read by it a moment ago), a copy records an event, and whoever
    reads the result waits on that event only: the compute stream through
    ``wait_event``, the host through ``Event.synchronize``. A device tensor made on a side
    stream and used elsewhere is marked with ``record_stream`` so the allocator does not
    hand its memory out again before that use is done.

Note: staging a send
    A stage-3 shard kept on the host goes up just before its all-gather, from a unit's
    hook. It is copied on the host-to-device stream without waiting for the compute stream
    (its device copy is allocated on that stream, so no memory the compute stream still
    reads is reused); the compute stream then waits for the copy's event, and the gather
    is launched as it would be without offload, in its own order. A shard in pageable
    memory (``offload_param.pin_memory`` false) is first copied into one of two pinned
    slots, so the transfer is still asynchronous: never a synchronous pageable copy inside
    a hook (``send_staging`` in the host-traffic ledger).

Note: the copy ledger
    :class:`CopyLedger` counts, beside the collective ledger, the bytes each copy between
    the host and the device moves, by direction (``to_device``, ``to_host``). It counts the
    copies the code issues where offloaded state crosses to or from the device, so on a
    CPU-only machine, where both sides are host memory, the counts are the ones a GPU run
    makes. Offload moves fp32 both ways (Note "the host does only Adam"); the host-traffic
    ledger (``traffic.py``) counts what the host's memory sees.

Note: the host does only Adam
    At the bound the host's cores and memory are the scarce side and the PCIe links and
    the GPU have room, so the host touches each parameter only for the optimizer step.
    Gradients are widened to fp32, averaged and unscaled on the device and come down in
    fp32 (4 bytes per element instead of 2, in the copies that run during backward), so
    Adam reads them as they land; masters go up in fp32 straight from their (pinned)
    home and are cast to the parameter dtype on the device. Casting on the host would add
    two passes over host memory per parameter (the widening, 2 bytes read and 4 written;
    the cast into a pinned slot, 4 read and 2 written), 12 of the ~44 bytes per parameter
    a step made the host move, on the cores that run Adam.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import ContextManager, Optional

import torch

from .traffic import HostTraffic, nbytes

TO_DEVICE, TO_HOST = "to_device", "to_host"


@dataclass
class CopyLedger:
    """Host <-> device copies and their bytes, by direction."""

    calls: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)

    def record(self, direction: str, tensor: torch.Tensor) -> None:
        self.calls[direction] += 1
        self.nbytes[direction] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.nbytes.clear()

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.nbytes)}


class Transfers:
    """Issues and counts the copies of one rank (Notes above); one per stage."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.ledger = CopyLedger()
        self.host = HostTraffic()     # Note "host traffic" in traffic.py
        self._streams: dict[str, "torch.cuda.Stream"] = {}
        self.pin = self.cuda                      # staging slots are page-locked on a GPU
        self._uploads = _PinnedRing(self)         # pageable masters on their way up
        self._sends = _PinnedRing(self)           # pageable stage-3 shards on their way up
        self.last_upload: Optional["torch.cuda.Event"] = None
        self.resident: set[int] = set()   # ids of masters kept on the device (ratio < 1)

    def _stream(self, direction: str, *, after_compute: bool = True) -> "torch.cuda.Stream":
        """The side stream for ``direction``; unless told otherwise it first waits for the
        work queued on the compute stream (Note: copy streams)."""
        if direction not in self._streams:
            self._streams[direction] = torch.cuda.Stream(self.device)
        stream = self._streams[direction]
        if after_compute:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        return stream

    # ------------------------------------------------------------------ down
    def to_host(self, out: torch.Tensor, grad: torch.Tensor) -> Optional["torch.cuda.Event"]:
        """Copy ``grad`` (on the device, in ``out``'s dtype) into host tensor ``out``.

        Returns the event to synchronize on before reading ``out`` (None: done already).
        """
        self.ledger.record(TO_HOST, grad)
        if grad.device.type != "cuda":
            out.copy_(grad)
            return None
        stream = self._stream(TO_HOST)
        with torch.cuda.stream(stream):
            out.copy_(grad, non_blocking=out.is_pinned())
            done = torch.cuda.Event()
            done.record(stream)
        grad.record_stream(stream)
        return done

    # ------------------------------------------------------------------ up
    def upload(self, master: torch.Tensor, dtype: torch.dtype,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``master`` (fp32, on the host) as ``dtype`` on the device, cast on the device
        (Note: the host does only Adam).

        A pinned master is copied straight from its home; a pageable one goes through one
        of two pinned slots first (so that copy can be asynchronous), the next record's
        staging overlapping this record's copy. The copy runs on the upload stream and the
        compute stream waits for it. With ``out`` (a device tensor) the values land there;
        otherwise a new tensor is returned.
        """
        if id(master) in self.resident:   # Note "partial offload" in updater.py
            return master.to(dtype) if out is None else out.copy_(master)
        self.ledger.record(TO_DEVICE, master)
        self.host.record("upload", read=nbytes(master))
        if not self.cuda:   # the "device" is host memory: the cast is the device's
            return master.to(dtype) if out is None else out.copy_(master)
        source = master
        if not master.is_pinned():
            source = self._uploads.take(master.numel(), master.dtype)
            source.copy_(master)
            self.host.record("upload_staging", read=nbytes(master), written=nbytes(master))
        stream = self._stream(TO_DEVICE)
        with torch.cuda.stream(stream):
            wide = torch.empty(master.shape, dtype=master.dtype, device=self.device)
            wide.copy_(source, non_blocking=True)
            target = out if out is not None else torch.empty(
                master.shape, dtype=dtype, device=self.device)
            target.copy_(wide)
            done = torch.cuda.Event()
            done.record(stream)
        if source is not master:
            self._uploads.used(done)
        self.last_upload = done
        torch.cuda.current_stream(self.device).wait_event(done)
        target.record_stream(torch.cuda.current_stream(self.device))
        return target

    def wait_uploads(self) -> None:
        """Block until the last upload has read its host memory (before that memory is
        handed to another record, as an NVMe swap slot is)."""
        done, self.last_upload = self.last_upload, None
        if done is not None:
            done.synchronize()

    def send(self, shard: torch.Tensor, device: torch.device
             ) -> tuple[torch.Tensor, ContextManager]:
        """A host shard (already in its dtype) on ``device``, for an all-gather: returns the
        device tensor and the context to launch the collective in (Note: staging a send).
        """
        self.ledger.record(TO_DEVICE, shard)
        if not self.cuda:
            return shard, contextlib.nullcontext()
        source = shard
        if not shard.is_pinned():   # never a synchronous pageable copy inside a hook
            source = self._sends.take(shard.numel(), shard.dtype)
            source.copy_(shard)
            self.host.record("send_staging", read=nbytes(shard), written=nbytes(shard))
        stream = self._stream(TO_DEVICE, after_compute=False)
        with torch.cuda.stream(stream):
            on_device = torch.empty(shard.shape, dtype=shard.dtype, device=self.device)
            on_device.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        if source is not shard:
            self._sends.used(done)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)
        on_device.record_stream(compute)
        return on_device, contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for every copy issued so far (before host memory they read is rewritten)."""
        for stream in self._streams.values():
            stream.synchronize()

    def tensors(self) -> list[torch.Tensor]:
        return self._uploads.tensors() + self._sends.tensors()


class _PinnedRing:
    """Two page-locked staging slots used in turn: the next copy's staging overlaps this
    one's transfer, and a slot is rewritten only after the copy that read it has landed."""

    def __init__(self, transfers: Transfers) -> None:
        self._transfers = transfers
        self._slots: list[Optional[torch.Tensor]] = [None, None]
        self._events: list[Optional["torch.cuda.Event"]] = [None, None]
        self._next = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        index = self._next
        self._next ^= 1
        event, self._events[index] = self._events[index], None
        if event is not None:
            event.synchronize()   # the copy that last read this slot has landed
        slot = self._slots[index]
        size = numel * torch.empty((), dtype=dtype).element_size()
        if slot is None or slot.numel() < size:
            slot = torch.empty(size, dtype=torch.uint8, pin_memory=self._transfers.pin)
            self._slots[index] = slot
        return slot[:size].view(dtype)

    def used(self, event: "torch.cuda.Event") -> None:
        """The copy just issued from the slot last taken lands at ``event``."""
        self._events[self._next ^ 1] = event

    def tensors(self) -> list[torch.Tensor]:
        return [s for s in self._slots if s is not None]
