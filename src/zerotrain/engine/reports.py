"""What the engine reports about a rank: memory by category, collective bytes by reach,
time per part of a step.

Why a module of its own: these read the stage, the module and the ledgers and change
nothing; kept apart, as a mixin :class:`~zerotrain.engine.ZeroEngine` inherits, they stay
out of the engine's training logic. The mixin reads what the engine sets in ``__init__``:
``module``, ``stage``, ``comm``, ``global_steps``, ``_timers`` and ``_comm_mark``.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from ..core.memory import StorageLedger
from ..estimate.peak import PeakTracker

if TYPE_CHECKING:
    from .surface import EngineSurface
else:
    EngineSurface = object   # typing only (surface.py)


class EngineReports(EngineSurface):
    """``memory_breakdown()``, ``communication_breakdown()``, ``timing_breakdown()``."""

    # (global_steps, ledger totals) at the last communication_breakdown()
    _comm_mark: tuple[int, dict[str, dict[str, int]]]
    _peaks: dict[str, int]   # peak_measured (measure_peak), peak_predicted (the planner)

    def timing_breakdown(self) -> dict[str, float]:
        """Seconds spent since the last call: forward, backward, step (device time from CUDA
        events on a GPU, Note in ``timers.py``) and, when offloading,
        the parts of the host step (docs/offload.md); counting starts afresh."""
        times = self._timers.take()
        times.update(self.stage.take_timings())
        return times

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held on this rank: parameters, gradients, optimizer_state, buffers; with
        offload also host_optimizer_state or nvme_optimizer_state (file-backed),
        host_parameters (stage-3 shards kept on the host) and host_gradients (the fp32
        gradient shard, the upload slots and, when speculative, the kept state); with
        ``zero_hpz_partition_size`` also hpz_parameters (hpZ's secondary copy, Ψ/H
        parameter-dtype elements; docs/multinode.md). Stage 3 adds two
        figures that are not held now: gathered_after_forward, the bytes of gathered
        parameters kept from the end of the last forward to its backward (the prefetch
        window; what autograd saved of them holds no memory), and
        peak_gathered_after_forward, the highest so far. Once measured or predicted (Note
        in :meth:`measure_peak`), peak_measured and peak_predicted: the peak of a step.

        Counts distinct storages, so views of one flat buffer count once.
        """
        ledger = StorageLedger()
        held = dict(self.stage.tensors_by_category())
        parameters: list[torch.Tensor] = list(self.module.parameters())
        ledger.add("parameters", parameters + held.pop("parameters", []))
        ledger.add("gradients", held.pop("gradients", []))
        ledger.add("optimizer_state", held.pop("optimizer_state", []))
        for category, tensors in held.items():
            if tensors:
                ledger.add(category, tensors)
        ledger.add("buffers", list(self.module.buffers()))
        out = {**ledger.bytes, **self.stage.memory_peaks()}
        out.update(self._peaks)   # peak_measured, peak_predicted: see measure_peak()
        return out

    @contextlib.contextmanager
    def measure_peak(self) -> Iterator[None]:
        """Measure the peak of live tensor storages on this rank over the steps run inside
        (what the engine holds when it opens, plus every storage an operation makes);
        ``memory_breakdown()`` then reports it as peak_measured, the highest so far. Why
        opt-in: it checks the live bytes after every operation, which slows the steps; the
        planner predicts the same figure (``zerotrain.planner.predict_engine_peak``, which
        sets peak_predicted)."""
        tracker = PeakTracker()
        held = [t for ts in self.stage.tensors_by_category().values() for t in ts
                if isinstance(t, torch.Tensor)]
        with tracker:
            tracker.add_existing(list(self.module.parameters()) + list(self.module.buffers())
                                 + held)
            yield
        self._peaks["peak_measured"] = max(tracker.peak, self._peaks.get("peak_measured", 0))

    @property
    def predicted_peak(self) -> Optional[int]:
        """The planner's predicted peak of a step on this rank, once noted (None before)."""
        return self._peaks.get("peak_predicted")

    def note_predicted_peak(self, nbytes: int) -> None:
        """Record the planner's prediction (``zerotrain.planner.predict_engine_peak``):
        ``memory_breakdown()`` reports it as peak_predicted, beside peak_measured."""
        self._peaks["peak_predicted"] = int(nbytes)

    def communication_breakdown(self) -> dict[str, Any]:
        """Bytes this rank's collectives carried since the last call, by reach and operation:
        ``{"steps": optimizer steps in the window, "intra_node": {op: bytes}, "cross_node":
        {op: bytes}}``. A group spanning nodes counts as cross-node (Note: intra-node and
        cross-node bytes in ``comm/ledger.py``); nodes come from torchrun's ``LOCAL_WORLD_SIZE``
        and ``GROUP_RANK``. With tensor parallelism, ``"tensor_parallel": {op: bytes}`` is the
        tensor-parallel group's traffic, the rest the data-parallel (and world) traffic.
        Counting starts afresh after each call."""
        steps, before = self._comm_mark
        now = reach_totals(self.comm.ledger)
        self._comm_mark = (self.global_steps, now)
        out: dict[str, Any] = {"steps": self.global_steps - steps}
        for reach, totals in now.items():
            diff = {op: n - before[reach].get(op, 0) for op, n in totals.items()}
            out[reach] = {op: n for op, n in diff.items() if n}
        taken = self.stage.take_tensor_parallel_bytes()
        if taken is not None:   # tensor parallelism: the other dimension's bytes (tp/stage.py)
            out["tensor_parallel"] = taken
        return out


def reach_totals(ledger) -> dict[str, dict[str, int]]:
    return {reach: dict(counter) for reach, counter in ledger.by_reach.items()}
