"""DeepSpeed's OneCycle and LRRangeTest: lr and beta1 sequences checked against values
worked out by hand from DeepSpeed's documented formulas.

Conventions (deepspeed/runtime/lr_schedules.py): after construction the optimizer holds the
lr of iteration -1; ``step()`` moves to iteration k and writes its lr. OneCycle places
iteration k at b = k + 1 in a cycle of T = first + second batches: with x = b/T - floor(b/T)
and r = first/T, the height is s = x/r while x <= r, else (1 - x)/(1 - r); lr = min +
(max - min) s and beta1 = max_mom - (max_mom - min_mom) s. From k = T on there is no second
cycle: decay batch j = k - T + 1 gives lr = min / (1 + decay_lr_rate j / decay_step_size)
and beta1 = max_mom (1 + decay_mom_rate j / decay_step_size). LRRangeTest gives
min (1 + rate (k + 1) / size), the fraction floored with the staircase.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

try:
    import zerotrain.errors  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from zerotrain.config import ZeroTrainConfigWarning, load_config
from zerotrain.errors import ConfigError
from zerotrain.schedules import LRRangeTest, OneCycle, build_scheduler

# min 0.01, max 0.05, first 4, second 6 (T = 10, r = 0.4), decay every 5 at rate 0.5;
# beta1 between 0.8 and 0.95, decay_mom_rate 0.01.
CYCLE = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.05, "cycle_first_step_size": 4,
         "cycle_second_step_size": 6, "decay_step_size": 5, "decay_lr_rate": 0.5,
         "cycle_min_mom": 0.8, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}
# k = 0..9: s = .25 .5 .75 1 | 5/6 4/6 3/6 2/6 1/6 0
CYCLE_S = [0.25, 0.5, 0.75, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0]
CYCLE_LR = [0.02, 0.03, 0.04, 0.05, 0.01 + 0.04 * 5 / 6, 0.01 + 0.04 * 4 / 6, 0.03,
            0.01 + 0.04 * 2 / 6, 0.01 + 0.04 / 6, 0.01]
CYCLE_MOM = [0.9125, 0.875, 0.8375, 0.8, 0.825, 0.85, 0.875, 0.9, 0.925, 0.95]
# k = 10..29 is decay batch j = 1..20: lr = 0.01 / (1 + 0.1 j), beta1 = 0.95 (1 + 0.002 j)
DECAY_LR = [0.01 / (1 + 0.1 * j) for j in range(1, 21)]
DECAY_MOM = [0.95 * (1 + 0.002 * j) for j in range(1, 21)]


def adam(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups, lr=lrs[0], betas=(0.9, 0.999))


def trace(sched, n: int) -> tuple[list[float], list[tuple]]:
    """lr and betas of the first group after each of n steps."""
    lrs, betas = [], []
    for _ in range(n):
        sched.step()
        group = sched.optimizer.param_groups[0]
        lrs.append(group["lr"])
        betas.append(tuple(group.get("betas", ())))
    return lrs, betas


# ----------------------------------------------------------------------------- OneCycle
def test_one_cycle_then_decay_over_three_cycle_lengths():
    opt = adam(0.1)
    sched = OneCycle(opt, **CYCLE)
    # a fresh run writes cycle_min_lr and (cycle_min_mom, 0.99) at construction
    assert opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    lrs, betas = trace(sched, 30)
    assert lrs == pytest.approx(CYCLE_LR + DECAY_LR)
    assert [b[0] for b in betas] == pytest.approx(CYCLE_MOM + DECAY_MOM)
    assert {b[1] for b in betas} == {0.99}     # beta2 is DeepSpeed's 0.99, not the 0.999 set
    assert lrs[19] == pytest.approx(0.005) and betas[19][0] == pytest.approx(0.969)
    assert sched.get_last_lr() == pytest.approx([0.01 / 3])
    (beta1, beta2), = sched.get_mom()
    assert beta1 == pytest.approx(0.95 * 1.04) and beta2 == 0.99


def test_one_cycle_heights_follow_the_cycle_shape():
    sched = OneCycle(adam(0.1), **CYCLE)
    for k, s in enumerate(CYCLE_S):
        sched.step(k)
        assert sched._scale_factor() == pytest.approx(s), k


def test_no_decay_holds_min_lr_and_max_momentum():
    params = dict(CYCLE, decay_step_size=0)
    lrs, betas = trace(OneCycle(adam(0.1), **params), 25)
    assert lrs[10:] == [0.01] * 15
    assert [b[0] for b in betas[10:]] == [0.95] * 15
    params = dict(CYCLE, decay_lr_rate=0.0, decay_mom_rate=0.0)   # rates 0: same
    lrs, betas = trace(OneCycle(adam(0.1), **params), 25)
    assert lrs[10:] == [0.01] * 15 and [b[0] for b in betas[10:]] == [0.95] * 15


def test_second_step_size_defaults_to_the_first():
    params = dict(CYCLE, cycle_second_step_size=None, cycle_first_step_size=4)
    lrs, _ = trace(OneCycle(adam(0.1), **params), 8)
    # T = 8, r = 0.5: s = .25 .5 .75 1 .75 .5 .25 0
    assert lrs == pytest.approx([0.01 + 0.04 * s for s in
                                 (0.25, 0.5, 0.75, 1, 0.75, 0.5, 0.25, 0)])


def test_stair_counts_warn_and_leave_the_cycle_continuous():
    with pytest.warns(ZeroTrainConfigWarning, match="stair_count"):
        stairs = OneCycle(adam(0.1), cycle_first_stair_count=2, **CYCLE)
    assert stairs.second_stair_count == 2        # defaults to the first count
    assert trace(stairs, 30) == trace(OneCycle(adam(0.1), **CYCLE), 30)


def test_without_cycle_momentum_betas_are_left_alone():
    opt = adam(0.1)
    lrs, betas = trace(OneCycle(opt, cycle_momentum=False, **CYCLE), 12)
    assert lrs == pytest.approx(CYCLE_LR + DECAY_LR[:2])
    assert set(betas) == {(0.9, 0.999)}


def test_sgd_has_no_betas_so_momentum_cycling_warns_and_is_off():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    with pytest.warns(ZeroTrainConfigWarning, match="cycle_momentum"):
        sched = OneCycle(opt, **CYCLE)
    lrs, _ = trace(sched, 10)
    assert lrs == pytest.approx(CYCLE_LR)
    assert opt.param_groups[0]["momentum"] == 0.9 and "betas" not in opt.param_groups[0]
    assert sched.get_mom() is None


def test_per_group_bounds_and_adam_step_uses_the_cycled_beta1():
    opt = adam(0.1, 0.2)
    sched = OneCycle(opt, **dict(CYCLE, cycle_min_lr=[0.01, 0.02], cycle_max_lr=[0.05, 0.1]))
    sched.step()                                  # k = 0, s = 0.25
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.02, 0.04])
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.9125, 0.9125])
    param = opt.param_groups[0]["params"][0]
    param.grad = torch.ones(1)
    opt.step()                                    # first Adam step: moves by ~lr
    assert opt.state[param]["exp_avg"].item() == pytest.approx(1 - 0.9125)


def test_resume_construction_leaves_lr_and_betas_alone():
    opt = adam(0.1)
    sched = OneCycle(opt, last_batch_iteration=3, **CYCLE)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    sched.step()                                  # k = 4
    assert opt.param_groups[0]["lr"] == pytest.approx(CYCLE_LR[4])
    assert opt.param_groups[0]["betas"][0] == pytest.approx(CYCLE_MOM[4])


# -------------------------------------------------------------------------- LRRangeTest
def test_range_test_continuous_and_staircase():
    opt = adam(0.5)
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                        lr_range_test_step_rate=0.5)
    assert opt.param_groups[0]["lr"] == 0.01
    lrs, _ = trace(sched, 8)
    assert lrs == pytest.approx([0.01 * (1 + 0.5 * b / 4) for b in range(1, 9)])
    assert lrs[3] == pytest.approx(0.015) and lrs[7] == pytest.approx(0.02)
    stairs = LRRangeTest(adam(0.5), lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                         lr_range_test_step_rate=0.5, lr_range_test_staircase=True)
    lrs, betas = trace(stairs, 8)
    assert lrs == pytest.approx([0.01] * 3 + [0.015] * 4 + [0.02])
    assert set(betas) == {(0.9, 0.999)}


def test_range_test_defaults_and_per_group_min():
    sched = LRRangeTest(adam(0.5, 0.5), lr_range_test_min_lr=[1e-3, 2e-3])
    assert (sched.step_size, sched.step_rate, sched.staircase) == (2000, 1.0, False)
    sched.step(1999)
    assert sched.get_last_lr() == pytest.approx([2e-3, 4e-3])
    default = LRRangeTest(adam(0.5))
    assert default.get_last_lr() == [1e-3]


# ---------------------------------------------------------------------- state and config
@pytest.mark.parametrize("type_name,params", [
    ("OneCycle", CYCLE),
    ("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
])
def test_state_dict_round_trip_mid_cycle(type_name, params):
    first = build_scheduler(type_name, params, adam(0.1, 0.05))
    trace(first, 6)
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"last_batch_iteration": 5}
    second = build_scheduler(type_name, params, adam(0.1, 0.05))
    second.load_state_dict(state)
    assert trace(second, 20) == trace(first, 20)


def test_config_accepts_both_types():
    for section in ({"type": "OneCycle", "params": CYCLE}, {"type": "LRRangeTest"}):
        cfg = load_config({"train_batch_size": 2, "scheduler": section}, world_size=1)
        assert cfg.scheduler.type == section["type"]


@pytest.mark.parametrize("params,key", [
    ({"cycle_first_step_size": -4}, "cycle_first_step_size"),
    ({"cycle_first_step_size": 0}, "cycle_first_step_size"),
    ({"cycle_second_step_size": -1}, "cycle_second_step_size"),
    ({"cycle_first_step_size": 2.5}, "cycle_first_step_size"),
    ({"decay_step_size": -5}, "decay_step_size"),
    ({"cycle_first_stair_count": -1}, "cycle_first_stair_count"),
    ({"cycle_min_lr": 0.1}, "cycle_min_lr"),                       # min > max
    ({"cycle_min_lr": -0.01}, "cycle_min_lr"),
    ({"cycle_max_lr": [0.05, 0.05]}, "cycle_max_lr"),              # one group
    ({"decay_lr_rate": -0.5}, "decay_lr_rate"),
    ({"cycle_min_mom": 0.99}, "cycle_min_mom"),                    # min > max
    ({"cycle_max_mom": 1.0}, "cycle_max_mom"),                     # not a beta1
    ({"decay_mom_rate": "0.1"}, "decay_mom_rate"),
    ({"cycle_momentum": "yes"}, "cycle_momentum"),
    ({"last_batch_iteration": -2}, "last_batch_iteration"),
    ({"cycle_first_stepsize": 4}, "cycle_first_stepsize"),          # unknown key
])
def test_one_cycle_bad_values_are_named(params, key):
    with pytest.raises(ConfigError) as err:
        build_scheduler("OneCycle", {**CYCLE, **params}, adam(0.1))
    assert err.value.path == f"scheduler.params.{key}"
    assert key in str(err.value)


def test_one_cycle_needs_both_bounds_and_suggests_keys():
    with pytest.raises(ConfigError) as err:
        build_scheduler("OneCycle", {"cycle_max_lr": 0.1}, adam(0.1))
    assert err.value.path == "scheduler.params.cycle_min_lr"
    with pytest.raises(ConfigError) as err:
        build_scheduler("OneCycle", {**CYCLE, "cycle_first_stepsize": 4}, adam(0.1))
    assert "cycle_first_step_size" in err.value.suggestion


@pytest.mark.parametrize("params,key", [
    ({"lr_range_test_step_size": 0}, "lr_range_test_step_size"),
    ({"lr_range_test_step_size": -10}, "lr_range_test_step_size"),
    ({"lr_range_test_step_rate": -1.0}, "lr_range_test_step_rate"),
    ({"lr_range_test_min_lr": -1e-3}, "lr_range_test_min_lr"),
    ({"lr_range_test_staircase": 1}, "lr_range_test_staircase"),
    ({"warmup_num_steps": 10}, "warmup_num_steps"),
])
def test_range_test_bad_values_are_named(params, key):
    opt = adam(0.1)
    with pytest.raises(ConfigError) as err:
        build_scheduler("LRRangeTest", params, opt)
    assert err.value.path == f"scheduler.params.{key}"
    assert opt.param_groups[0]["lr"] == 0.1                # refused before touching it


# ------------------------------------------------------------- DeepSpeed, when importable
@pytest.mark.parametrize("type_name,params", [
    ("OneCycle", CYCLE),
    ("OneCycle", dict(CYCLE, cycle_second_step_size=None, decay_step_size=0)),
    ("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
])
def test_sequences_equal_deepspeeds(type_name, params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    ours = build_scheduler(type_name, params, adam(0.1))
    theirs = getattr(lr_schedules, type_name)(adam(0.1), **params)
    assert trace(ours, 35) == trace(theirs, 35)                 # bit for bit
