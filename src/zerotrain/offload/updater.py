"""The optimizer step on the host, one record at a time.

Note: the host step
    ``step`` receives each record's reduced gradient shard on the training device with the
    factors that finish it (``offload/gradients.py``); most records' copies to pinned host
    memory started during backward, as their buckets completed. For record k it then

    1. waits for record k's gradient copy only (finished on the device and landed in fp32,
       Note "the host does only Adam" in transfers.py), while record k+1's NVMe state is
       being read,
    2. steps record k's fp32 master with the optimizer (torch's fused CPU Adam) over that
       record alone (``threads.step_alone``), with the host-step thread count,
    3. ``publish(k)`` sends record k's new fp32 values up on the copy stream, cast to the
       parameter dtype on the device (the stage knows where they go), so the GPU takes
       them in while the host steps record k+1, and
    4. record k's NVMe state is written back by a worker thread.

    Records are stepped in the order their gradients arrived (``order``: the order the
    buckets completed in backward, the same on every rank), so the first record stepped is
    the first whose copy landed. With ``speculative`` most records were stepped already,
    during backward (``speculation.py``); the step validates them and publishes.

    Host memory holds the fp32 state (12 bytes per parameter of this rank's shard) and the
    fp32 gradient shard (4 bytes per parameter), plus the kept state when speculative.

Note: partial offload
    With ``offload_optimizer.ratio`` below 1 (DeepSpeed's Twin-Flow key: the fraction
    offloaded) the first ``1 - ratio`` of the records, in layout order as DeepSpeed splits
    its sub-groups, move their fp32 masters to the device at ``attach``; their optimizer
    state is created there, their gradients never leave the device, and at the step they
    are stepped there with the device update's arithmetic (``Gradients.on_device``, the
    same kernel over the record alone) and published by a cast where they are, before
    any record is stepped on the host: on a GPU their kernels are queued at once and run
    while the host steps the rest as usual, so the step's host part shrinks by the ratio
    kept and the device's part hides behind it.
    At stage 3 a record's master is a view of its unit's master, so the stage places
    whole units instead (``storage.place_masters``: the first records, rounded down to
    whole units, allocated on the device from the start) and names them to ``attach``.
    Either way the first records are the last whose gradients arrive in backward: the
    host steps the others while backward still runs, and the device steps these at the
    end, when the host has the least left to do.

Note: delayed parameter update
    With ``offload_optimizer.dpu`` the step does not wait for the host: the gradients are
    copied to the host and the update runs on a worker thread while the next micro-batches
    run forward and backward on the parameters of the step before (the ZeRO-Offload
    paper's one-step delay). ``settle`` joins it; the stage then publishes. The worker
    runs on one core fewer than the host step (the main thread keeps launching the next
    micro-batches' kernels) and with the training device set as its own. Gradients still
    go down per record as they arrive in backward, into the host buffer the worker reads
    for that record, once the running update has stepped that record (it steps in the
    same arrival order, so it is usually done); a record it has not reached yet goes down
    when the step starts.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch

from .device import DeviceUpdater
from .gradients import Gradients, HostGradients, as_grad_of
from .speculation import KeptStates
from .step_timings import StepTimings
from .storage import HostStorage, Storage
from .swapped_adam import SwappedAdamState
from .threads import available_cores, host_step_threads, step_alone, threads
from .trace import NoTimeline, Timeline, rank_path


def build_updater(optimizer: torch.optim.Optimizer, storage: Storage, *,
                  delayed: bool = False, speculative: bool = False,
                  trace_path: Optional[str] = None, rank: int = 0, ratio: float = 1.0
                  ) -> "DeviceUpdater | HostUpdater":
    """The updater for where ``storage`` keeps the masters (the stage calls it once its
    optimizer exists)."""
    if not storage.steps_on_host():
        return DeviceUpdater(optimizer)
    timeline = Timeline(rank_path(trace_path, rank), rank) if trace_path else None
    return HostUpdater(optimizer, storage, delayed=delayed, speculative=speculative,
                       timeline=timeline, ratio=ratio)


class HostUpdater:
    """Runs ``optimizer`` over host-resident records (Note "the host step")."""

    def __init__(self, optimizer: torch.optim.Optimizer, storage: HostStorage, *,
                 delayed: bool = False, speculative: bool = False,
                 timeline: Optional[Timeline] = None, ratio: float = 1.0) -> None:
        self.optimizer = optimizer
        self.ratio = ratio
        self._on_device: set[int] = set()   # records kept and stepped on the device
        self.storage = storage
        self.delayed = delayed
        self.speculative = speculative and not delayed
        self.gradients = HostGradients(storage.transfers, storage.staging)
        self.timeline = timeline or NoTimeline()
        self.threads = host_step_threads(os.environ, available_cores())  # Note in threads.py
        self._worker = (ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="zerotrain-host-step",
            initializer=_worker_setup, initargs=(storage.transfers.device,))
            if delayed or self.speculative else None)
        self._pending: Optional[Future] = None
        self._consumed: set[int] = set()   # records the running delayed update has stepped
        self._masters: list[torch.Tensor] = []
        self._unscale = 1.0        # the factor speculation assumes (1 / loss scale)
        self._speculated: dict[int, Future] = {}
        allocate = storage.zeros if storage.swaps else (
            lambda n, dtype: torch.empty(n, dtype=dtype))   # kept state never crosses PCIe
        self.kept = KeptStates(allocate, storage.transfers.host)
        self.swapped = SwappedAdamState(optimizer, storage)   # NVMe: each master's state
        self._group_of: dict[int, int] = {}   # id(master) -> its optimizer group
        self._groups_key: tuple = ()
        # seconds spent, by part, since the last ``take_timings`` (Note in step_timings.py)
        self.timings = StepTimings()

    # ------------------------------------------------------------------ set-up
    def attach(self, masters: Sequence[torch.Tensor],
               on_device: Optional[Sequence[int]] = None) -> None:
        """Give each master its optimizer state up front, allocated by the storage (NVMe
        needs the state in its files; the optimizer then finds it and does not allocate).
        ``on_device``: the records whose masters the stage placed on the device itself
        (stage 3, ``place_masters``); without it the first ``1 - ratio`` are moved there."""
        self._masters = list(masters)
        self._keep_on_device(masters, on_device)
        if self.storage.swaps:
            self.swapped.allocate(masters, self.kept if self.speculative else None)

    def _keep_on_device(self, masters: Sequence[torch.Tensor],
                        placed: Optional[Sequence[int]] = None) -> None:
        """``offload_optimizer.ratio``: the first ``1 - ratio`` of the records (DeepSpeed's
        split of its sub-groups) move their masters to the device, where their state is
        then created and stepped; they never cross (Note "partial offload"). ``placed``:
        records whose masters are on the device already."""
        transfers = self.storage.transfers
        if placed is None:
            placed = range(int((1 - self.ratio) * len(masters)))
            for k in placed:
                if transfers.cuda:
                    masters[k].data = masters[k].data.to(transfers.device)
        for k in placed:
            transfers.resident.add(id(masters[k]))
            self._on_device.add(k)

    # ------------------------------------------------------------------ stepping
    def stream(self, k: int, shard: torch.Tensor, world: int) -> None:
        """Record k's gradient is final: finish it on the device and start its copy to the
        host now, during backward (Note "streaming gradients down" in gradients.py), and
        with ``speculative`` queue its step (Note in speculation.py). Not with the delayed
        update, whose worker may still be reading the host buffers."""
        if k in self._on_device:
            return
        if self.delayed:   # into the buffer the running update has finished with, if so
            if self._pending is None or k in self._consumed:
                self.gradients.fetch(k, shard, world, self._unscale)
            return
        if k in self._speculated:   # a second boundary backward: start over
            self.retract()
        self.timeline.instant("gradient ready", k)
        self.gradients.fetch(k, shard, world, self._unscale)
        if self.speculative and k < len(self._masters):
            self._speculated[k] = self._worker.submit(self._speculate, k)

    def forget(self) -> None:
        """The step was skipped: speculative steps are undone, copies streamed for it are
        not used."""
        self.retract()
        self.gradients.forget()

    def retract(self) -> None:
        """Undo every speculative step not validated yet (Note in speculation.py): the
        gradients were discarded, or something reads the state before the step."""
        if not self._speculated:
            return
        speculated, self._speculated = self._speculated, {}
        for future in speculated.values():
            future.cancel()
        for k, future in speculated.items():
            if not future.cancelled():
                future.result()
        self.storage.drain()
        for k in list(self.kept.kept):
            master = self._masters[k]
            self.kept.restore(k, master, self.optimizer.state[master])

    def host_tensors(self) -> list[torch.Tensor]:
        """Host buffers of the step: fp32 gradients, upload slots, kept state."""
        return (self.gradients.tensors() + self.storage.transfers.tensors()
                + self.kept.tensors())

    def step(self, masters: Sequence[torch.Tensor], grads: Gradients,
             publish: Callable[[int], None], order: Optional[Sequence[int]] = None) -> None:
        """Step every record, in ``order`` (default: as laid out); ``publish(k)`` right
        after record k (not in delayed mode, where the caller publishes after ``settle``)."""
        order = list(order) if order is not None else list(range(len(masters)))
        if not self.delayed:
            try:
                self._run(masters, grads, publish, order)
            finally:
                self._unscale = grads.unscale
                self.timeline.write()
            return
        self._unscale = grads.unscale
        for k in order:   # on the host before the shards are freed; most came during backward
            if not self.gradients.ready(k, grads.world, grads.coef):
                self.gradients.fetch(k, grads.shards[k], grads.world, grads.coef)
        if any(g.device.type == "cuda" for g in grads.shards):
            self.storage.transfers.synchronize()
        self._consumed = set()
        self._pending = self._worker.submit(self._run, list(masters), grads, None, order)

    def settle(self) -> bool:
        """Wait for a delayed update; True if one was pending (the caller then publishes)."""
        if self._pending is None:
            return False
        pending, self._pending = self._pending, None
        with self.timings.timed("offload_delayed_wait"), self.timeline.span("delayed wait"):
            pending.result()
        self.timeline.write()
        return True

    def take_timings(self) -> dict[str, float]:
        """The seconds by part since the last call, and start counting afresh."""
        return self.timings.take()

    def close(self) -> None:
        try:
            if self._worker is not None:
                self.settle()
                self.retract()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            self.storage.close()

    def _worker_threads(self) -> int:
        """The worker's intra-op threads: the host step's count less one core, left to the
        thread that launches the device's kernels meanwhile."""
        return max(1, (self.threads or torch.get_num_threads()) - 1)

    def _run(self, masters: Sequence[torch.Tensor], grads: Gradients,
             publish: Optional[Callable[[int], None]], order: Sequence[int]) -> None:
        try:
            done = self._validated(grads) if self._speculated else set()
            with threads(self._worker_threads() if self.delayed else self.threads):
                self._run_records(masters, grads, publish, order, done)
        except BaseException:
            self.storage.abort()   # every tensor back home, no slot lost; the step failed
            raise

    def _validated(self, grads: Gradients) -> set[int]:
        """Wait for the speculative steps; keep those that stand, restore the others
        (Note in speculation.py). Returns the records needing no step now."""
        speculated, self._speculated = self._speculated, {}
        with self.timings.timed("offload_speculation_wait"):
            for future in speculated.values():
                future.result()
            self.storage.drain()
        standing = set()
        for k in speculated:
            master = self._masters[k]
            group = self.optimizer.param_groups[self._group_index(master)]
            if self.kept.stands(k, coef=grads.coef, world=grads.world, group=group):
                self.kept.kept.pop(k)
                standing.add(k)
            else:
                self.kept.restore(k, master, self.optimizer.state[master])
        return standing

    def _run_records(self, masters: Sequence[torch.Tensor], grads: Gradients,
                     publish: Optional[Callable[[int], None]], order: Sequence[int],
                     done: set[int]) -> None:
        todo = [k for k in order if k not in done and k not in self._on_device]
        if todo:
            self.swapped.prefetch(todo[0], masters[todo[0]])
            self._fetch_ready(todo[0], grads)
        for k in order:   # first: on a GPU their kernels then run while the host steps
            if k in self._on_device:
                self._step_on_device(k, masters[k], grads, publish)
        ahead = iter(todo[1:])
        for k in order:
            stepped = k not in done
            if k in self._on_device:
                continue
            if stepped:
                following = next(ahead, None)
                if following is not None:   # its state read and its gradient copied
                    self.swapped.prefetch(following, masters[following])   # while k steps
                    self._fetch_ready(following, grads)
                with (self.timings.timed("offload_gradient_wait"),
                      self.timeline.span("gradient wait", k)):
                    grad = self.gradients.take(k, grads)
                with self.timings.timed("offload_nvme_read_wait"):
                    self.storage.swap_in(k)
                self._adam(k, masters[k], grad)
                if self.delayed:
                    self._consumed.add(k)   # its host buffer may take the next gradient
            else:
                self.gradients.forget_one(k)
            if publish is not None:
                with self.timings.timed("offload_publish"), self.timeline.span("upload", k):
                    publish(k)
            if stepped:
                if self.storage.swaps:   # the slot is reused once written back
                    self.storage.transfers.wait_uploads()
                self.storage.swap_out(k)
        with self.timings.timed("offload_nvme_write_wait"):
            self.storage.drain()

    def _step_on_device(self, k: int, master: torch.Tensor, grads: Gradients,
                        publish: Optional[Callable[[int], None]]) -> None:
        """A record kept on the device (``ratio``): the device update's arithmetic, alone."""
        master.grad = as_grad_of(master, grads.on_device(k))
        step_alone(self.optimizer, self._group_index(master), master)
        master.grad = None
        if publish is not None:
            publish(k)

    def _fetch_ready(self, k: int, grads: Gradients) -> None:
        """Start record k's copy down unless one finished as ``grads`` finishes it is on its
        way: a record not streamed during backward, or streamed for a step that then
        clipped. One record ahead only, so the device holds at most two finished fp32
        copies at a time."""
        if not self.gradients.ready(k, grads.world, grads.coef):
            self.gradients.fetch(k, grads.shards[k], grads.world, grads.coef)

    def _adam(self, k: int, master: torch.Tensor, grad: torch.Tensor) -> None:
        """Record k's optimizer step over ``grad`` (fp32, on the host), counted."""
        with self.timings.timed("offload_cpu_adam"), self.timeline.span("adam", k):
            master.grad = as_grad_of(master, grad)
            step_alone(self.optimizer, self._group_index(master), master)
            master.grad = None
        state = [v for v in self.optimizer.state[master].values()
                 if isinstance(v, torch.Tensor) and v.numel() > 1]
        size = master.numel() * master.element_size()
        moved = sum(v.numel() * v.element_size() for v in state)
        self.storage.transfers.host.record("adam", read=2 * size + moved,
                                           written=size + moved)

    def _speculate(self, k: int) -> None:
        """On the worker: record k's step as soon as its gradient lands, its state kept
        first (Note in speculation.py)."""
        with threads(self._worker_threads()):
            self._speculate_now(k)

    def _speculate_now(self, k: int) -> None:
        master = self._masters[k]
        with self.timeline.span("gradient wait", k):
            grad, coef, world = self.gradients.wait(k)
        self.swapped.prefetch(k, master)
        self.storage.swap_in(k)
        try:
            group = self.optimizer.param_groups[self._group_index(master)]
            with self.timeline.span("keep", k):
                kept = self.kept.keep(k, master, self.optimizer.state[master], group)
            kept.coef, kept.world = coef, world
            self._adam(k, master, grad)
            kept.valid = True
        finally:
            self.storage.swap_out(k)

    def _group_index(self, master: torch.Tensor) -> int:
        """The optimizer group of ``master`` (the map is rebuilt when the groups change,
        as after ``load_state_dict``; checking costs one look per group, not per tensor)."""
        key = tuple(id(group["params"]) for group in self.optimizer.param_groups)
        if key != self._groups_key or id(master) not in self._group_of:
            self._group_of = {id(p): g for g, group in enumerate(self.optimizer.param_groups)
                              for p in group["params"]}
            self._groups_key = key
        return self._group_of[id(master)]


def _worker_setup(device: torch.device) -> None:
    """The worker thread's own setting: on a GPU, the device its copies and events belong
    to (its thread count is set per task, ``threads``)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
