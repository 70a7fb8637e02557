"""The planner's predicted peak equals the measured peak of the same step on 2 gloo ranks,
and a configuration ``fit`` recommends stays under its budget when run for real.

Measured the same way on both sides: live storages after every operation
(``zerotrain.estimate.peak.PeakTracker``), from the model as built to the end of the
optimizer step, on rank 0. The prediction runs the engine on fake tensors in this process as
rank 0 of a fake world of 2; the measurement runs it on real tensors on 2 gloo ranks.
"""
import os
from dataclasses import replace

import pytest
import torch

from zerotrain.planner import StepSpec, plan_peak

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "configs")
TOLERANCE = 0.05
# Both families at every stage; activation checkpointing and three more families are in
# bench/planner_check.py (docs/BENCHMARKS.md).
CASES = [(family, stage, False) for family in ("gpt2-tiny", "llama-tiny") for stage in range(4)]


def _spec(family, stage, ac):
    return StepSpec(os.path.join(CONFIGS, f"{family}.json"), micro_batch=2, seq_len=32,
                    gpus=2, stage=stage, dtype="fp32", activation_checkpointing=ac,
                    backend="gloo")


def _measure(rank, world, specs):
    import torch

    from zerotrain.estimate.peak import PeakTracker
    from zerotrain.planner import build_model, counting_gloo_copies, run_step

    out = []
    for spec in specs:
        torch.manual_seed(0)
        model = build_model(spec)
        tracker = PeakTracker()
        with counting_gloo_copies(tracker):
            engine, _ = run_step(spec, model, tracker)
        out.append((tracker.peak, tracker.where))
        engine.destroy()
        del engine, model
    return out


@pytest.mark.slow
def test_predicted_peak_matches_measured_peak_on_two_ranks(worlds):
    measured = worlds.run(2, _measure, [_spec(*case) for case in CASES])[0]
    rows = []
    for case, (real, where) in zip(CASES, measured):
        predicted = plan_peak(_spec(*case))
        error = predicted.peak_bytes / real - 1
        rows.append((case, predicted.peak_bytes, real, round(100 * error, 2),
                     predicted.where, where))
    bad = [row for row in rows if abs(row[3]) > 100 * TOLERANCE]
    assert not bad, "\n".join(map(str, rows))
    # where the peak happens is part of the prediction
    assert all(row[4] == row[5] for row in rows), "\n".join(map(str, rows))


TP_CASES = [("llama-tiny", 1), ("llama-tiny", 2), ("gpt2-tiny", 2), ("llama-tiny", 3),
            ("gpt2-tiny", 3)]


def _tp_spec(family, stage):
    return StepSpec(os.path.join(CONFIGS, f"{family}.json"), micro_batch=2, seq_len=32,
                    gpus=4, stage=stage, dtype="fp32", backend="gloo", tp=2)


@pytest.mark.slow
def test_predicted_peak_with_tensor_parallelism_matches_measured_peak_on_four_ranks(worlds):
    """T=2 x DP=2: rank 0 of the fake world holds its slices, as the real rank 0 does."""
    measured = worlds.run(4, _measure, [_tp_spec(*case) for case in TP_CASES])[0]
    rows = []
    for case, (real, where) in zip(TP_CASES, measured):
        predicted = plan_peak(_tp_spec(*case))
        whole = plan_peak(replace(_tp_spec(*case), tp=1))
        error = predicted.peak_bytes / real - 1
        rows.append((case, predicted.peak_bytes, real, round(100 * error, 2),
                     predicted.where, where, whole.peak_bytes))
    bad = [row for row in rows if abs(row[3]) > 100 * TOLERANCE]
    assert not bad, "\n".join(map(str, rows))
    assert all(row[4] == row[5] for row in rows), "\n".join(map(str, rows))
    # the split is what was planned: slices are smaller than the whole model's states
    assert all(row[1] < row[6] for row in rows), "\n".join(map(str, rows))


@pytest.mark.slow
def test_a_fitted_configuration_run_for_real_stays_under_its_budget(worlds):
    from zerotrain.planner import fit

    base = _spec("gpt2-tiny", 3, False)
    budget = int(plan_peak(base).peak_bytes * 1.002)   # just above stage 3's prediction
    chosen = fit(base, budget)
    assert chosen is not None and chosen.peak_bytes <= budget
    peaks = [peak for [(peak, _)] in worlds.run(2, _measure, [chosen.spec])]
    assert max(peaks) <= budget, (chosen.spec, peaks, budget)
    # nothing bigger was recommended than asked for: micro-batch x accumulation kept
    assert chosen.spec.micro_batch * chosen.spec.gradient_accumulation == 2


def test_fit_returns_none_when_nothing_fits():
    from zerotrain.planner import fit

    assert fit(_spec("gpt2-tiny", 3, False), 1000) is None


class _LossOf(torch.nn.Module):
    """A causal LM called as ``predict_engine_peak`` calls a model: positional ids in,
    the loss out."""

    def __init__(self, family):
        super().__init__()
        from zerotrain.planner import build_model

        self.lm = build_model(_tp_spec(family, 3))

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids).loss


def test_a_running_engines_prediction_traces_stage_3_with_tensor_parallelism():
    """``predict_engine_peak``'s traced step (``_trace_built``, here in this process) with a
    config holding stage 3 and AutoTP: the same peak as the planner's; what stage 3 does not
    do with tensor parallelism is refused by its key."""
    import functools

    from zerotrain.errors import ConfigError
    from zerotrain.planner import ds_config_for
    from zerotrain.planner.live import _trace_built

    spec = _tp_spec("llama-tiny", 3)
    config = ds_config_for(spec)
    build = functools.partial(_LossOf, "llama-tiny")
    shapes = [((2, 32), torch.int64)]
    assert _trace_built(build, config, 4, shapes, "gloo") == plan_peak(spec).peak_bytes
    hpz = {**config, "zero_optimization": {**config["zero_optimization"],
                                           "zero_hpz_partition_size": 2}}
    with pytest.raises(ConfigError, match="zero_hpz_partition_size"):
        _trace_built(build, hpz, 4, shapes, "gloo")


@pytest.mark.slow
def test_the_traced_step_counts_muon_state_momentum_for_matrices_adam_for_the_rest():
    """Muon keeps one fp32 momentum per element of the matrices it steps (use_muon: two or
    more dimensions, no embed / lm_head in the name) and Adam's two moments for the rest:
    at stage 2 on 2 ranks the traced optimizer state is (12Ψ - 4Ψm) / 2 bytes in fp32."""
    from zerotrain.muon import tag_model
    from zerotrain.planner import build_model
    spec = replace(_spec("gpt2-tiny", 2, False), optimizer="muon")
    model = build_model(spec)
    tag_model(model)
    psi = sum(p.numel() for p in model.parameters())
    psi_m = sum(p.numel() for p in model.parameters() if p.use_muon)
    assert 0 < psi_m < psi
    muon = plan_peak(spec).breakdown["optimizer_state"]
    adam = plan_peak(_spec("gpt2-tiny", 2, False)).breakdown["optimizer_state"]
    assert abs(adam - 12 * psi / 2) <= 64 and abs(muon - (12 * psi - 4 * psi_m) / 2) <= 64, (
        adam, muon, psi, psi_m)
