"""The optimizer step on the host, one record at a time.

Note: the host step
    ``step`` receives each record's gradient shard on the training device, already averaged,
    unscaled and clipped (``stages/base.prepare_gradients``). For record k it then

    1. copies the gradient of record k+1 into a pinned staging buffer (asynchronous on
       CUDA) and starts reading record k+1's state from NVMe, while
    2. the optimizer (torch's fused CPU Adam) steps record k's fp32 master,
    3. ``publish(k)`` sends record k's new values to the device (the stage knows how), and
    4. record k's NVMe state is written back by a worker thread.

    Host memory holds the fp32 state (12 bytes per parameter of this rank's shard) plus two
    staging buffers of the largest record: no full-size fp32 gradient copy.

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
    paper's one-step delay). ``settle`` joins it; the stage then publishes. Because the
    gradient must outlive the step, this mode keeps one fp32 gradient shard on the host
    (4 more bytes per parameter of the shard).
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

    def step(self, masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             publish: Callable[[int], None]) -> None:
        for master, grad in zip(masters, grads):
            master.grad = grad
        self.optimizer.step()   # one call: fused and foreach kernels see every shard
        for master in masters:
            master.grad = None
        for k in range(len(masters)):
            publish(k)

    def settle(self) -> bool:
        return False

    def take_timings(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def build_updater(optimizer: torch.optim.Optimizer, storage: Storage, *,
                  delayed: bool = False) -> "DeviceUpdater | HostUpdater":
    """The updater for where ``storage`` keeps the masters (the stage calls it once its
    optimizer exists)."""
    if not storage.on_host:
        return DeviceUpdater(optimizer)
    return HostUpdater(optimizer, storage, delayed=delayed)


class HostUpdater:
    """Runs ``optimizer`` over host-resident records (Note "the host step")."""

    def __init__(self, optimizer: torch.optim.Optimizer, storage: HostStorage, *,
                 delayed: bool = False) -> None:
        self.optimizer = optimizer
        self.storage = storage
        self.delayed = delayed
        self._staging: list[torch.Tensor] = []
        self._held: list[torch.Tensor] = []        # delayed mode: gradients kept for the worker
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotrain-dpu")
                        if delayed else None)
        self._pending: Optional[Future] = None
        self._homes: dict[int, dict[str, torch.Tensor]] = {}   # NVMe: each master's state
        self._ready: list[Optional[torch.cuda.Event]] = [None, None]  # staging copies landed
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
    def step(self, masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             publish: Callable[[int], None]) -> None:
        """Step every record; ``publish(k)`` right after record k (not in delayed mode,
        where the caller publishes after ``settle``)."""
        if not self.delayed:
            self._run(masters, grads, publish)
            return
        if len(self._held) != len(grads):
            self._held = [self.storage.staging(g.numel()) for g in grads]
        for held, grad in zip(self._held, grads):
            held.copy_(grad, non_blocking=True)
        if any(g.device.type == "cuda" for g in grads):
            torch.cuda.current_stream().synchronize()   # the worker reads them next
        self._pending = self._worker.submit(self._run, list(masters), self._held, None)

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

    def _run(self, masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             publish: Optional[Callable[[int], None]]) -> None:
        try:
            with threads(self.threads):
                self._run_records(masters, grads, publish)
        except BaseException:
            self.storage.abort()   # every tensor back home, no slot lost; the step failed
            raise

    def _run_records(self, masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     publish: Optional[Callable[[int], None]]) -> None:
        count = len(masters)
        if count == 0:
            return
        self._prefetch(masters, 0)
        host = self._to_host(grads[0], 0)
        for k, master in enumerate(masters):
            if k + 1 < count:
                self._prefetch(masters, k + 1)
            with self._timed("offload_gradient_wait"):
                self._wait_staged(k % 2)
            grad = host
            if k + 1 < count:
                host = self._to_host(grads[k + 1], (k + 1) % 2)
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

    def _to_host(self, grad: torch.Tensor, index: int) -> torch.Tensor:
        """``grad`` as an fp32 host tensor: itself on CPU, else staging buffer ``index``'s
        copy (asynchronous from a GPU; ``_wait_staged(index)`` before reading it)."""
        self._ready[index] = None
        if grad.device.type == "cpu" and grad.dtype == torch.float32:
            return grad
        while len(self._staging) <= index:
            self._staging.append(self.storage.staging(0))
        if self._staging[index].numel() < grad.numel():
            self._staging[index] = self.storage.staging(grad.numel())
        buffer = self._staging[index][: grad.numel()]
        buffer.copy_(grad, non_blocking=True)
        if grad.device.type == "cuda":
            self._ready[index] = torch.cuda.Event()
            self._ready[index].record()
        return buffer

    def _wait_staged(self, index: int) -> None:
        """Wait for staging copy ``index`` only (not for later work on the stream)."""
        event, self._ready[index] = self._ready[index], None
        if event is not None:
            event.synchronize()


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
