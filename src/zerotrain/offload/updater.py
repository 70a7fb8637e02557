"""The optimizer step on the host, one record at a time.

Note: the host step
    ``step`` receives each record's reduced gradient shard on the training device with the
    factors that finish it (``offload/gradients.py``); most records' copies to pinned host
    memory started during backward, as their buckets completed. For record k it then

    1. waits for record k's gradient copy only, widens it to fp32 and finishes it (the
       same arithmetic as on the device), while record k+1's NVMe state is being read,
    2. steps record k's fp32 master with the optimizer (torch's fused CPU Adam) over that
       record alone (``threads.step_alone``), with the host-step thread count,
    3. ``publish(k)`` casts record k's new values to the parameter dtype on the host and
       sends them up on the copy stream (the stage knows where they go), so the GPU takes
       them in while the host steps record k+1, and
    4. record k's NVMe state is written back by a worker thread.

    Host memory holds the fp32 state (12 bytes per parameter of this rank's shard), the
    gradient shard in its wire dtype (2 bytes per parameter for bf16), one fp32 buffer of
    the largest record and two 16-bit upload slots: no full-size fp32 gradient copy.

Note: where the time goes
    ``timings`` adds up, per part, the seconds the step spends waiting for gradients to
    reach the host (``offload_gradient_wait``), for NVMe reads and writes
    (``offload_nvme_read_wait``, ``offload_nvme_write_wait``), in the CPU Adam
    (``offload_cpu_adam``), sending new values to the device (``offload_publish``) and, with
    ``dpu``, waiting for the delayed update (``offload_delayed_wait``). With
    ``wall_clock_breakdown`` the engine logs them next to forward/backward/step, so a slow
    offloaded step shows which part is slow.

Note: delayed parameter update
    With ``offload_optimizer.dpu`` the step does not wait for the host: the gradients are
    copied to the host and the update runs on a worker thread while the next micro-batches
    run forward and backward on the parameters of the step before (the ZeRO-Offload
    paper's one-step delay). ``settle`` joins it; the stage then publishes. The gradients
    go down when the step starts rather than during backward, since the worker may still
    be reading the host buffers while the next backward runs.
"""
from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch

from ..errors import ConfigError
from .gradients import Gradients, HostGradients
from .storage import HostStorage, Storage
from .threads import available_cores, host_step_threads, step_alone, threads

_ADAM_STATE = ("exp_avg", "exp_avg_sq")


class DeviceUpdater:
    """No offload: one optimizer step over every record on the device, then publish."""

    delayed = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def attach(self, masters: Sequence[torch.Tensor]) -> None:
        pass

    def step(self, masters: Sequence[torch.Tensor], grads: Gradients,
             publish: Callable[[int], None]) -> None:
        for k, master in enumerate(masters):
            master.grad = grads.on_device(k)
        self.optimizer.step()   # one call: fused and foreach kernels see every shard
        for master in masters:
            master.grad = None
        for k in range(len(masters)):
            publish(k)

    def settle(self) -> bool:
        return False

    def stream(self, k: int, shard: torch.Tensor, wire: torch.dtype) -> None:
        """Nothing leaves the device."""

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def forget(self) -> None:
        pass

    def take_timings(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def build_updater(optimizer: torch.optim.Optimizer, storage: Storage, *,
                  delayed: bool = False) -> "DeviceUpdater | HostUpdater":
    """The updater for where ``storage`` keeps the masters (the stage calls it once its
    optimizer exists)."""
    if not storage.steps_on_host():
        return DeviceUpdater(optimizer)
    return HostUpdater(optimizer, storage, delayed=delayed)


class HostUpdater:
    """Runs ``optimizer`` over host-resident records (Note "the host step")."""

    def __init__(self, optimizer: torch.optim.Optimizer, storage: HostStorage, *,
                 delayed: bool = False) -> None:
        self.optimizer = optimizer
        self.storage = storage
        self.delayed = delayed
        self.gradients = HostGradients(storage.transfers, storage.staging)
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotrain-dpu")
                        if delayed else None)
        self._pending: Optional[Future] = None
        self._homes: dict[int, dict[str, torch.Tensor]] = {}   # NVMe: each master's state
        self._lock = threading.Lock()
        self._group_of: dict[int, int] = {}   # id(master) -> its optimizer group
        self._groups_key: tuple = ()
        self.threads = host_step_threads(os.environ, available_cores())  # Note in threads.py
        # seconds spent, by part, since the last ``take_timings`` (Note "where the time goes")
        self.timings: dict[str, float] = defaultdict(float)

    # ------------------------------------------------------------------ set-up
    def attach(self, masters: Sequence[torch.Tensor]) -> None:
        """Give each master its optimizer state up front, allocated by the storage (NVMe
        needs the state in its files; the optimizer then finds it and does not allocate)."""
        if not self.storage.swaps:
            return
        for group in self.optimizer.param_groups:
            if type(self.optimizer).__name__ not in ("Adam", "AdamW") or group.get("amsgrad"):
                raise ConfigError("zero_optimization.offload_optimizer.device",
                                  '"nvme" swaps Adam/AdamW state (exp_avg, exp_avg_sq); '
                                  f"{type(self.optimizer).__name__}"
                                  f"{' with amsgrad' if group.get('amsgrad') else ''} "
                                  'is not supported there; use device "cpu"', value="nvme")
        numel = 0
        for master in masters:
            state = self.optimizer.state[master]
            state.setdefault("step", torch.zeros((), dtype=torch.float32))
            # held here too: the files stay reserved whatever replaces the state's entries
            self._homes[id(master)] = {key: self.storage.zeros(master.numel())
                                       for key in _ADAM_STATE}
            state.update(self._homes[id(master)])
            numel = max(numel, master.numel() * (1 + len(_ADAM_STATE)))
        self.storage.reserve_slots(numel)

    # ------------------------------------------------------------------ stepping
    def stream(self, k: int, shard: torch.Tensor, wire: torch.dtype) -> None:
        """Record k's gradient is final: start its copy to the host now, during backward
        (Note "streaming gradients down" in gradients.py). Not with the delayed update,
        whose worker may still be reading the host buffers."""
        if not self.delayed:
            self.gradients.fetch(k, shard, wire)

    def forget(self) -> None:
        """The step was skipped: copies streamed for it are not used."""
        self.gradients.forget()

    def host_tensors(self) -> list[torch.Tensor]:
        """Host buffers of the step: gradients in their wire dtype, the upload slots."""
        return self.gradients.tensors() + self.storage.transfers.tensors()

    def step(self, masters: Sequence[torch.Tensor], grads: Gradients,
             publish: Callable[[int], None]) -> None:
        """Step every record; ``publish(k)`` right after record k (not in delayed mode,
        where the caller publishes after ``settle``)."""
        if not self.delayed:
            self._run(masters, grads, publish)
            return
        for k in range(len(masters)):   # on the host before the next backward starts
            self.gradients.fetch(k, grads.shards[k], grads.wire[k])
        if any(g.device.type == "cuda" for g in grads.shards):
            self.storage.transfers.synchronize()
        self._pending = self._worker.submit(self._run, list(masters), grads, None)

    def settle(self) -> bool:
        """Wait for a delayed update; True if one was pending (the caller then publishes)."""
        if self._pending is None:
            return False
        pending, self._pending = self._pending, None
        with self._timed("offload_delayed_wait"):
            pending.result()
        return True

    def take_timings(self) -> dict[str, float]:
        """The seconds by part since the last call, and start counting afresh."""
        with self._lock:
            taken, self.timings = dict(self.timings), defaultdict(float)
        return taken

    def _timed(self, part: str) -> "_Timer":
        return _Timer(self, part)

    def close(self) -> None:
        try:
            if self._worker is not None:
                self.settle()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            self.storage.close()

    def _run(self, masters: Sequence[torch.Tensor], grads: Gradients,
             publish: Optional[Callable[[int], None]]) -> None:
        try:
            with threads(self.threads):
                self._run_records(masters, grads, publish)
        except BaseException:
            self.storage.abort()   # every tensor back home, no slot lost; the step failed
            raise

    def _run_records(self, masters: Sequence[torch.Tensor], grads: Gradients,
                     publish: Optional[Callable[[int], None]]) -> None:
        count = len(masters)
        if count == 0:
            return
        self._prefetch(masters, 0)
        for k in range(count):   # whatever was not streamed during backward goes down now
            if not self.gradients.fetched(k):
                self.gradients.fetch(k, grads.shards[k], grads.wire[k])
        for k, master in enumerate(masters):
            if k + 1 < count:
                self._prefetch(masters, k + 1)
            with self._timed("offload_gradient_wait"):
                grad = self.gradients.take(k, grads)
            with self._timed("offload_nvme_read_wait"):
                self.storage.swap_in(k)
            with self._timed("offload_cpu_adam"):
                master.grad = grad.view(master.shape)
                step_alone(self.optimizer, self._group_index(master), master)
                master.grad = None
            if publish is not None:
                with self._timed("offload_publish"):
                    publish(k)
            self.storage.swap_out(k)
        with self._timed("offload_nvme_write_wait"):
            self.storage.drain()

    def _group_index(self, master: torch.Tensor) -> int:
        """The optimizer group of ``master`` (the map is rebuilt when the groups change,
        as after ``load_state_dict``; checking costs one look per group, not per tensor)."""
        key = tuple(id(group["params"]) for group in self.optimizer.param_groups)
        if key != self._groups_key or id(master) not in self._group_of:
            self._group_of = {id(p): g for g, group in enumerate(self.optimizer.param_groups)
                              for p in group["params"]}
            self._groups_key = key
        return self._group_of[id(master)]

    def _prefetch(self, masters: Sequence[torch.Tensor], k: int) -> None:
        if not self.storage.swaps:
            return
        state = self._adopted_state(masters[k])
        self.storage.prefetch(k, [masters[k]] + [state[key] for key in _ADAM_STATE])

    def _adopted_state(self, master: torch.Tensor) -> dict:
        """The master's state, back in its NVMe files if something (a checkpoint load)
        replaced or dropped an entry: values are copied in, and a missing entry (a load
        without optimizer state) starts from zero, as a fresh Adam would."""
        state = self.optimizer.state[master]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for home in self._homes[id(master)].values():
                home.zero_()
        for key, home in self._homes[id(master)].items():
            value = state.get(key)
            if value is not home:
                if value is not None:
                    home.copy_(value)
                state[key] = home
        return state

class _Timer:
    """Adds a block's seconds to ``updater.timings`` (under its lock: the delayed update's
    worker thread times its parts too)."""

    def __init__(self, updater: HostUpdater, part: str) -> None:
        self.updater, self.part = updater, part

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        with self.updater._lock:
            self.updater.timings[self.part] += time.perf_counter() - self.start
