"""At run time: ``engine.memory_breakdown()`` reports the measured peak of the steps run
under ``engine.measure_peak()`` beside the planner's prediction for the same engine
(``zerotrain.planner.predict_engine_peak``, traced in a process of its own), on 2 gloo
ranks; the two agree within 5%, as the planner does offline (tests/dist/test_planner.py)."""
import functools

import pytest

TOLERANCE = 0.05


def _train_and_report(rank, world, stage):
    import torch

    import zerotrain
    from zerotrain.demo.model import GPT, GPTConfig
    from zerotrain.planner import predict_engine_peak

    build = functools.partial(GPT, GPTConfig(block_size=64, n_layer=2, d_model=64))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=build(), config=config)
    x = torch.randint(0, 256, (4, 64))
    before = engine.memory_breakdown()
    with engine.measure_peak():
        for _ in range(2):
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
    # the same figure on every rank of this symmetric run: traced once, on rank 0
    predicted = predict_engine_peak(engine, build, (x, x), config) if rank == 0 else None
    report = engine.memory_breakdown()
    engine.destroy()
    return before, report, predicted


@pytest.mark.slow
def test_memory_breakdown_reports_measured_peak_beside_prediction(worlds):
    (before, report, predicted), (_, other, _) = worlds.run(2, _train_and_report, 3)
    assert "peak_measured" not in before and "peak_predicted" not in before
    assert "peak_predicted" not in other and other["peak_measured"] > 0
    assert report["peak_predicted"] == predicted
    error = report["peak_predicted"] / report["peak_measured"] - 1
    assert abs(error) <= TOLERANCE, report
