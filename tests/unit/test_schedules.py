"""DeepSpeed warmup schedules: lr sequences checked against hand-derived values.

Conventions from DeepSpeed's lr_schedules.py: after construction the optimizer holds the lr
for iteration -1 (warmup start); each ``step()`` moves to the next iteration k and writes
its lr. Linear warmup gives min + (max - min) * k / W for k < W; log warmup gives
min + (max - min) * ln(k + 1) / ln(W).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

try:
    import zerotrain.errors  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from zerotrain.errors import ConfigError, StateError
from zerotrain.schedules import (SCHEDULERS, WarmupCosineLR, WarmupDecayLR, WarmupLR,
                                 build_scheduler)


def make_optimizer(*lrs: float) -> torch.optim.Optimizer:
    """An SGD optimizer with one single-parameter group per lr."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def lrs_of(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


def run(sched, n: int) -> list[list[float]]:
    """The optimizer lrs after each of n steps."""
    out = []
    for _ in range(n):
        sched.step()
        out.append(lrs_of(sched.optimizer))
    return out


def flat(seq: list[list[float]]) -> list[float]:
    return [lrs[0] for lrs in seq]


# ----------------------------------------------------------------------------- WarmupLR
def test_warmup_linear_sequence_and_construction_lr():
    opt = make_optimizer(0.1)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=4,
                     warmup_type="linear")
    assert lrs_of(opt) == [0.0]  # constructor already replaced the optimizer's 0.1
    assert sched.get_last_lr() == [0.0]
    assert flat(run(sched, 6)) == pytest.approx([0.0, 0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3])
    assert sched.get_last_lr() == pytest.approx([1e-3])
    assert sched.get_lr() == pytest.approx([1e-3])


def test_warmup_log_sequence():
    opt = make_optimizer(0.1)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=4)
    # ln(k+1)/ln(4): k=1 -> 1/2, k=3 -> 1 (log warmup peaks one step before W).
    expected = [0.0, 0.5e-3, 1e-3 * math.log(3) / math.log(4), 1e-3, 1e-3]
    assert flat(run(sched, 5)) == pytest.approx(expected)


def test_first_optimizer_step_uses_warmup_min_lr():
    opt = make_optimizer(0.1)
    WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10)
    param = opt.param_groups[0]["params"][0]
    param.grad = torch.ones(1)
    opt.step()
    assert param.item() == pytest.approx(-0.01)  # not -0.1, the optimizer's own lr


def test_warmup_max_lr_defaults_to_optimizer_lr():
    sched = WarmupLR(make_optimizer(0.1), warmup_num_steps=2, warmup_type="linear")
    assert flat(run(sched, 3)) == pytest.approx([0.0, 0.05, 0.1])


def test_warmup_num_steps_is_at_least_two():
    sched = WarmupLR(make_optimizer(0.1), warmup_max_lr=1e-3, warmup_num_steps=1,
                     warmup_type="linear")
    assert flat(run(sched, 3)) == pytest.approx([0.0, 0.5e-3, 1e-3])


def test_warmup_per_group_lists():
    opt = make_optimizer(0.1, 0.2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 1e-4], warmup_max_lr=[1e-3, 2e-3],
                     warmup_num_steps=4, warmup_type="linear")
    assert lrs_of(opt) == pytest.approx([0.0, 1e-4])
    assert run(sched, 3)[-1] == pytest.approx([0.5e-3, 1.05e-3])


def test_explicit_step_index_and_tensor_lr():
    opt = make_optimizer(0.1)
    lr_tensor = torch.tensor(0.1)
    opt.param_groups[0]["lr"] = lr_tensor
    sched = WarmupLR(opt, warmup_max_lr=1e-3, warmup_num_steps=4, warmup_type="linear")
    sched.step(2)
    assert opt.param_groups[0]["lr"] is lr_tensor  # updated in place
    assert lr_tensor.item() == pytest.approx(0.5e-3)
    assert sched.get_last_lr() == pytest.approx([0.5e-3])


def test_resume_construction_leaves_optimizer_alone():
    opt = make_optimizer(0.1)
    sched = WarmupLR(opt, warmup_max_lr=1e-3, warmup_num_steps=4, warmup_type="linear",
                     last_batch_iteration=1)
    assert lrs_of(opt) == [0.1]
    with pytest.raises(StateError):
        sched.get_last_lr()
    sched.step()
    assert lrs_of(opt) == pytest.approx([0.5e-3])


# ------------------------------------------------------------------------ WarmupDecayLR
def test_warmup_decay_sequence_to_zero():
    sched = WarmupDecayLR(make_optimizer(0.1), total_num_steps=10, warmup_min_lr=0.0,
                          warmup_max_lr=1e-3, warmup_num_steps=4, warmup_type="linear")
    # Decay gamma for k >= W is (total - k) / (total - W) = (10 - k) / 6, floored at 0.
    expected = [0.0, 0.25e-3, 0.5e-3, 0.75e-3,  # k = 0..3 warmup
                1e-3, 5e-3 / 6, 4e-3 / 6, 0.5e-3, 2e-3 / 6, 1e-3 / 6, 0.0, 0.0, 0.0]
    assert flat(run(sched, 13)) == pytest.approx(expected)


def test_warmup_decay_ends_at_min_lr():
    sched = WarmupDecayLR(make_optimizer(0.1), total_num_steps=10, warmup_min_lr=1e-4,
                          warmup_max_lr=1e-3, warmup_num_steps=4, warmup_type="linear")
    seq = flat(run(sched, 12))
    assert seq[7] == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert seq[10:] == pytest.approx([1e-4, 1e-4])


@settings(max_examples=50, deadline=None)
@given(warmup=st.integers(1, 20), extra=st.integers(0, 20), k=st.integers(0, 60),
       kind=st.sampled_from(["log", "linear"]))
def test_warmup_decay_stays_between_min_and_max(warmup, extra, k, kind):
    sched = WarmupDecayLR(make_optimizer(0.1), total_num_steps=warmup + extra,
                          warmup_min_lr=1e-5, warmup_max_lr=1e-3, warmup_num_steps=warmup,
                          warmup_type=kind)
    sched.step(k)
    assert 1e-5 - 1e-12 <= sched.get_last_lr()[0] <= 1e-3 + 1e-12


# ----------------------------------------------------------------------- WarmupCosineLR
def test_warmup_cosine_per_group_sequence():
    opt = make_optimizer(0.1, 0.01)
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_min_ratio=0.2, warmup_num_steps=4,
                           cos_min_ratio=0.1, warmup_type="linear")
    assert lrs_of(opt) == [0.0, 0.0]  # DeepSpeed starts at 0, not at warmup_min_ratio
    # Warmup ratio 0.2 + 0.8 * k / 4; then with p = (k - 3) / 6 clamped to 1:
    # ratio = 0.1 + 0.9 * (1 + cos(pi * p)) / 2.
    ratios = [0.2, 0.4, 0.6, 0.8,
              0.1 + 0.9 * (1 + math.sqrt(3) / 2) / 2,  # k=4, p=1/6
              0.1 + 0.9 * 0.75,                       # k=5, p=1/3
              0.55,                                   # k=6, p=1/2
              0.1 + 0.9 * 0.25,                       # k=7, p=2/3
              None, 0.1, 0.1, 0.1]                    # k>=9 stays at cos_min_ratio
    seq = run(sched, len(ratios))
    for k, ratio in enumerate(ratios):
        if ratio is not None:
            assert seq[k] == pytest.approx([0.1 * ratio, 0.01 * ratio]), k
    assert sched.get_lr_ratio() == pytest.approx(0.1)


def test_warmup_cosine_log_warmup():
    sched = WarmupCosineLR(make_optimizer(1.0), total_num_steps=10, warmup_num_steps=4)
    assert flat(run(sched, 4)) == pytest.approx(
        [0.0, 0.5, math.log(3) / math.log(4), 1.0])


# ---------------------------------------------------------------------------- state dict
@pytest.mark.parametrize("type_name,params", [
    ("WarmupLR", {"warmup_max_lr": 1e-3, "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4,
                       "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4,
                        "warmup_min_ratio": 0.1}),
])
def test_state_dict_round_trip(type_name, params):
    first = build_scheduler(type_name, params, make_optimizer(0.1, 0.05))
    run(first, 6)
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"last_batch_iteration": 5}

    second = build_scheduler(type_name, params, make_optimizer(0.1, 0.05))
    second.load_state_dict(state)
    assert run(second, 10) == run(first, 10)  # same arithmetic, so bit-identical


# --------------------------------------------------------------------------- config errors
def test_registry_and_builder_types():
    assert set(SCHEDULERS) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                               "LRRangeTest"}
    sched = build_scheduler("WarmupDecayLR", {"total_num_steps": 10}, make_optimizer(0.1))
    assert isinstance(sched, WarmupDecayLR)
    assert sched.max_lrs == [0.001]  # WarmupDecayLR's own default


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError) as err:
        build_scheduler("WarmupLR", {"warmup_num_step": 10}, make_optimizer(0.1))
    assert err.value.path == "scheduler.params.warmup_num_step"
    assert "warmup_num_steps" in err.value.suggestion


def test_key_of_another_schedule_is_unknown():
    with pytest.raises(ConfigError) as err:
        build_scheduler("WarmupLR", {"total_num_steps": 10}, make_optimizer(0.1))
    assert err.value.path == "scheduler.params.total_num_steps"


def test_unknown_type_name():
    with pytest.raises(ConfigError) as err:
        build_scheduler("WarmupLr", {}, make_optimizer(0.1))
    assert err.value.path == "scheduler.type"
    assert "WarmupLR" in err.value.suggestion


@pytest.mark.parametrize("type_name", ["WarmupDecayLR", "WarmupCosineLR"])
def test_missing_total_num_steps(type_name):
    with pytest.raises(ConfigError) as err:
        build_scheduler(type_name, {"warmup_num_steps": 10}, make_optimizer(0.1))
    assert err.value.path == "scheduler.params.total_num_steps"


@pytest.mark.parametrize("params,key,value", [
    ({"warmup_num_steps": -5}, "warmup_num_steps", -5),
    ({"warmup_num_steps": 0}, "warmup_num_steps", 0),
    ({"warmup_num_steps": "10"}, "warmup_num_steps", "10"),
    ({"warmup_num_steps": 2.5}, "warmup_num_steps", 2.5),
    ({"warmup_num_steps": True}, "warmup_num_steps", True),
    ({"total_num_steps": -1}, "total_num_steps", -1),
    ({"warmup_max_lr": "1e-3"}, "warmup_max_lr", "1e-3"),
    ({"warmup_min_lr": -1e-4}, "warmup_min_lr", -1e-4),
    ({"warmup_max_lr": [1e-3, 1e-3]}, "warmup_max_lr", [1e-3, 1e-3]),
    ({"warmup_type": "linaer"}, "warmup_type", "linaer"),
    ({"last_batch_iteration": -2}, "last_batch_iteration", -2),
])
def test_bad_values_name_key_and_value(params, key, value):
    with pytest.raises(ConfigError) as err:
        build_scheduler("WarmupDecayLR", {"total_num_steps": 10, **params}, make_optimizer(0.1))
    assert err.value.path == f"scheduler.params.{key}"
    assert err.value.value == value
    assert key in str(err.value)


def test_bad_cosine_ratio_and_warmup_type_suggestion():
    with pytest.raises(ConfigError) as err:
        build_scheduler("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ratio": -0.1},
                        make_optimizer(0.1))
    assert err.value.path == "scheduler.params.cos_min_ratio"
    with pytest.raises(ConfigError) as err:
        WarmupLR(make_optimizer(0.1), warmup_type="linaer")
    assert "linear" in err.value.suggestion
