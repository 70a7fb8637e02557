"""Predict the peak memory of one training step on a rank by running the real engine on
fake tensors.

Why a trace and not a formula: a formula drifts from the engine (bucket sizes, the stage-3
prefetch window, the persistence threshold, the flat buffers and their padding, what
autograd saves). Here ``zerotrain.initialize`` and one forward, backward and optimizer step
run for real, in this one process, as rank 0 of a world of N over torch's fake process
group (collectives return at once), under ``FakeTensorMode`` (no memory is allocated, a
storage still reports its bytes); :class:`~zerotrain.estimate.peak.PeakTracker` adds up the
live storages after every operation. The same :func:`run_step` measured with real tensors
on N gloo ranks is what the suite compares the prediction with (tests/dist/test_planner.py).

The package, one job a module: ``spec`` (what is planned: :class:`StepSpec`, the model it
names, its DeepSpeed config, and :class:`StepPeak`, the result), ``fake_world`` (rank 0 of a
fake world under ``FakeTensorMode``, the backend's buffers included), ``trace`` (one step
traced, :func:`plan_peak`, and ``--fit``'s search over configurations) and ``live`` (the
prediction for a running engine, traced in a process of its own).
"""
from __future__ import annotations

from .fake_world import counting_gloo_copies, fake_world
from .live import predict_engine_peak
from .spec import BACKENDS, PlanError, StepPeak, StepSpec, build_model, ds_config_for
from .trace import STEPS, breakdown_at_peak, candidates, fit, plan_peak, run_step

__all__ = ["BACKENDS", "PlanError", "StepSpec", "StepPeak", "build_model",
           "counting_gloo_copies", "ds_config_for", "fit", "plan_peak", "predict_engine_peak",
           "run_step", "STEPS", "breakdown_at_peak", "candidates", "fake_world"]
