"""Tests for ``zerotrain demo``: a short real run on 2 CPU processes, the data split, the
embedded config, and the report without matplotlib."""
from __future__ import annotations

import csv
import importlib.util
import re
import subprocess
import sys

import pytest

from zerotrain.config import load_config
from zerotrain.demo import default_config
from zerotrain.demo.data import load_corpus

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _demo(out_dir, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotrain.cli", "demo", "--tiny", "--steps",
                           "6", "--nproc", "2", "--out", str(out_dir), *extra],
                          capture_output=True, text=True, timeout=170)


@pytest.mark.slow
def test_short_demo_trains_on_two_processes_and_writes_its_report(tmp_path):
    """The default stage, 3."""
    out_dir = tmp_path / "demo"
    done = _demo(out_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"Validation loss: ([0-9.]+) before training -> ([0-9.]+) after 6 steps",
                      done.stdout)
    assert match, done.stdout
    before, after = map(float, match.groups())
    assert after < before
    assert "step 6/6" in done.stderr  # rank 0's progress bar
    assert f"Output folder: {out_dir.resolve()}" in done.stdout
    assert "rank 0" in done.stdout and "rank 1" in done.stdout  # memory gathered from both
    # the last step's measured peak on both ranks, the planner's beside it (traced on rank 0)
    measured = re.search(r"peak of the last step +- +([0-9.]+) +([0-9.]+)", done.stdout)
    predicted = re.search(r"predicted \(planner\) +- +([0-9.]+) +-", done.stdout)
    assert measured and predicted, done.stdout + done.stderr
    assert abs(float(predicted.group(1)) / float(measured.group(1)) - 1) <= 0.05, done.stdout
    rows = list(csv.DictReader(open(out_dir / "loss.csv", encoding="utf-8")))
    assert [row["step"] for row in rows] == [str(step) for step in range(7)]
    assert (out_dir / "sample.txt").read_text(encoding="utf-8").startswith("def ")
    assert (out_dir / "summary.json").exists() and (out_dir / "ds_config.json").exists()
    assert (out_dir / "loss.png").exists() == HAS_MATPLOTLIB
    if not HAS_MATPLOTLIB:
        assert "pip install" in done.stdout


def test_corpus_split_is_by_file_deterministic_and_disjoint():
    first, second = load_corpus(), load_corpus()
    assert first.train.equal(second.train) and first.val.equal(second.val)
    assert first.train_files > 5 * first.val_files > 0
    x, y = first.val_batch(8, 16, rank=1, world=2)
    assert x.shape == (4, 16) and x[:, 1:].equal(y[:, :-1])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_embedded_config_is_valid_for_every_stage(stage):
    config = load_config(default_config(stage=stage, steps=10, micro_batch=8), world_size=2)
    assert config.zero_optimization.stage == stage and config.precision == "fp32"


def test_bad_config_is_refused_before_any_process_starts(tmp_path, monkeypatch, capsys):
    """In this process (``python -m zerotrain.cli`` itself is run by the test above): the
    exit status is 2 and the message names the key, and nothing was launched."""
    from zerotrain.cli import main
    from zerotrain.demo import run

    def no_launch(*args, **kwargs):
        raise AssertionError("the demo launched processes for a bad config")

    monkeypatch.setattr(run, "_launch", no_launch)
    path = tmp_path / "bad.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {}}')
    assert main(["demo", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "did you mean zero_optimization" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _results(*, gradients: int) -> dict:
    """What the demo's ranks hand the report: 2 steps at stage 2 on 2 ranks."""
    return {
        "history": {"train": [(1, 5.0, 0.5), (2, 4.0, 1.0)], "val": [(0, 5.5), (2, 4.2)],
                    "train_seconds": 1.0, "tokens_per_step": 100},
        "sample": "def f():", "memory": [{"parameters": 400, "gradients": gradients,
                                          "optimizer_state": 400, "buffers": 0}] * 2,
        "checkpoint": None, "world_size": 2, "stage": 2, "num_params": 100,
        "marks": {"initialized": 1.0, "trained": 2.0}, "train_files": 9, "val_files": 1,
        "train_bytes": 10**6, "val_bytes": 10**5, "val_loss_uniform": 5.545}


def test_report_without_matplotlib_still_writes_the_csv(tmp_path, monkeypatch):
    from zerotrain.demo.report import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    results = _results(gradients=200)
    text = write_report(results, config=default_config(stage=2, steps=2, micro_batch=1),
                        out_dir=tmp_path, launched_at=0.0, finished_at=3.0)
    assert (tmp_path / "loss.csv").exists() and not (tmp_path / "loss.png").exists()
    assert "matplotlib is not installed" in text and 'pip install -e ".[demo]"' in text
    assert "5.500 before training -> 4.200 after 2 steps" in text
    assert "ZeRO-2's formula" in text and "8Ψ/N" in text


def test_report_says_why_freed_gradient_shards_read_zero(tmp_path, monkeypatch):
    from zerotrain.demo.report import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    results = _results(gradients=0)
    args = dict(config=default_config(stage=2, steps=2, micro_batch=1), out_dir=tmp_path,
                launched_at=0.0, finished_at=3.0)
    text = " ".join(write_report(results, **args).split())
    assert "gradients read 0 because their shards are freed" in text
    results["memory"] = [{"parameters": 400, "gradients": 200, "optimizer_state": 400}] * 2
    assert "gradients read 0" not in " ".join(write_report(results, **args).split())


def test_report_shows_the_measured_peak_beside_the_predicted_one(tmp_path, monkeypatch):
    from zerotrain.demo.report import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    results = _results(gradients=200)
    results["memory"] = [{**results["memory"][0], "peak_measured": 2_000_000,
                          "peak_predicted": 2_050_000}, {**results["memory"][1],
                                                         "peak_measured": 2_010_000}]
    text = write_report(results, config=default_config(stage=2, steps=2, micro_batch=1),
                        out_dir=tmp_path, launched_at=0.0, finished_at=3.0)
    assert re.search(r"peak of the last step +- +2\.00 +2\.01", text), text
    assert re.search(r"predicted \(planner\) +- +2\.05 +-", text), text
