"""Precision policy and the fp16 loss scaler.

``LossScaler`` must reproduce DeepSpeed's ``DynamicLossScaler.update_scale``
(deepspeed/runtime/fp16/loss_scaler.py, the rule DeepSpeed has shipped since 0.3):

* overflow: if hysteresis is spent (``delayed_shift == 1`` or ``cur_hysteresis == 1``) the
  scale becomes ``max(scale / 2, min_scale)``, else one unit of hysteresis is consumed;
  either way ``last_overflow_iter = cur_iter``;
* no overflow: with ``consecutive_hysteresis`` hysteresis is refilled; then if
  ``(cur_iter - last_overflow_iter) % scale_window == 0`` the scale doubles (and without
  ``consecutive_hysteresis`` hysteresis is refilled there);
* ``cur_iter += 1`` every call.

So the scale grows after exactly ``scale_window`` consecutive clean steps (counted from the
start or from the last overflow). DeepSpeed raises at the floor by default
(``raise_error_at_min_scale``); zerotrain clamps at ``min_loss_scale`` instead.
"""
from __future__ import annotations

import json
import sys
from collections import OrderedDict, namedtuple
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    import zerotrain.core.precision  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from zerotrain.config import FP16Config
from zerotrain.core.precision import (DTYPES, LossScaler, NoLossScaling, PrecisionPolicy,
                                 loss_scaling)

O, C = True, False  # overflow, clean step


def dynamic(init=2.0 ** 16, window=1000, hysteresis=2, consecutive=False, min_scale=1.0):
    return LossScaler(init_scale=init, dynamic=True, scale_window=window, hysteresis=hysteresis,
                      consecutive_hysteresis=consecutive, min_scale=min_scale)


def scales(scaler: LossScaler, overflows) -> list[float]:
    """The loss scale after each update."""
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.loss_scale)
    return out


class DeepSpeedDynamicLossScaler:
    """DeepSpeed's update rule, transcribed in its own terms (floor instead of raising)."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift,
                 consecutive_hysteresis):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


# --------------------------------------------------------------------------- hysteresis
def test_with_hysteresis_two_the_first_overflow_keeps_the_scale_and_the_second_halves():
    assert scales(dynamic(hysteresis=2), [O, O, O]) == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14]


def test_with_hysteresis_one_every_overflow_halves():
    assert scales(dynamic(hysteresis=1), [O, O, C, O]) == [2.0 ** 15, 2.0 ** 14, 2.0 ** 14,
                                                          2.0 ** 13]


def test_with_hysteresis_three_the_third_overflow_halves():
    assert scales(dynamic(hysteresis=3), [O, O, O, O]) == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15,
                                                          2.0 ** 14]


def test_without_consecutive_hysteresis_a_clean_step_does_not_refill_hysteresis():
    # O uses the hysteresis; C (no growth yet) does not refill it; the next O halves.
    assert scales(dynamic(hysteresis=2, window=100), [O, C, O]) == [2.0 ** 16, 2.0 ** 16,
                                                                   2.0 ** 15]


def test_with_consecutive_hysteresis_a_clean_step_refills_hysteresis():
    assert scales(dynamic(hysteresis=2, window=100, consecutive=True),
                  [O, C, O, C, O, O]) == [2.0 ** 16] * 5 + [2.0 ** 15]


def test_growth_refills_hysteresis_without_consecutive_hysteresis():
    # window 3: O (hysteresis 2 -> 1), three clean steps grow the scale and refill it,
    # so the next overflow is absorbed again.
    scaler = dynamic(init=8.0, hysteresis=2, window=3)
    assert scales(scaler, [O, C, C, C, O, O]) == [8.0, 8.0, 8.0, 16.0, 16.0, 8.0]


# --------------------------------------------------------------------------- growth
def test_scale_doubles_after_exactly_window_clean_steps_from_the_start():
    scaler = dynamic(init=1.0, window=4)
    assert scales(scaler, [C] * 12) == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0,
                                        8.0]


def test_scale_doubles_after_exactly_window_clean_steps_after_an_overflow():
    scaler = dynamic(init=64.0, window=3, hysteresis=1)
    assert scales(scaler, [C, O, C, C, C, C, C, C]) == [64.0, 32.0, 32.0, 32.0, 64.0, 64.0,
                                                        64.0, 128.0]


def test_an_overflow_restarts_the_growth_window():
    scaler = dynamic(init=16.0, window=3, hysteresis=2)
    # two clean steps, an absorbed overflow, then three more clean steps before growth
    assert scales(scaler, [C, C, O, C, C, C]) == [16.0, 16.0, 16.0, 16.0, 16.0, 32.0]


# --------------------------------------------------------------------------- floor
def test_scale_never_drops_below_min_loss_scale():
    scaler = dynamic(init=8.0, hysteresis=1, min_scale=2.0, window=1000)
    assert scales(scaler, [O, O, O, O]) == [4.0, 2.0, 2.0, 2.0]


def test_halving_clamps_to_a_min_loss_scale_between_powers_of_two():
    scaler = dynamic(init=8.0, hysteresis=1, min_scale=3.0)
    assert scales(scaler, [O, O]) == [4.0, 3.0]


# --------------------------------------------------------------------------- vs DeepSpeed
@settings(max_examples=60, deadline=None)
@given(overflows=st.lists(st.booleans(), max_size=60),
       window=st.integers(1, 6), hysteresis=st.integers(1, 4),
       consecutive=st.booleans(), init_power=st.integers(0, 20),
       min_scale=st.sampled_from([0.25, 1.0, 4.0]))
def test_dynamic_scaler_matches_deepspeed_update_scale_step_by_step(
        overflows, window, hysteresis, consecutive, init_power, min_scale):
    ours = dynamic(init=2.0 ** init_power, window=window, hysteresis=hysteresis,
                   consecutive=consecutive, min_scale=min_scale)
    ref = DeepSpeedDynamicLossScaler(2.0 ** init_power, window, min_scale, hysteresis,
                                     consecutive)
    for step, overflow in enumerate(overflows):
        ours.update(overflow)
        ref.update_scale(overflow)
        assert ours.loss_scale == ref.cur_scale, f"step {step}"
        assert ours.cur_hysteresis == ref.cur_hysteresis, f"step {step}"
        assert ours.cur_iter == ref.cur_iter
        assert ours.last_overflow_iter == ref.last_overflow_iter


# --------------------------------------------------------------------------- static
@settings(max_examples=20, deadline=None)
@given(overflows=st.lists(st.booleans(), max_size=40))
def test_static_scaler_never_changes_its_scale(overflows):
    scaler = LossScaler(init_scale=128.0, dynamic=False, scale_window=1, hysteresis=1)
    assert set(scales(scaler, overflows)) <= {128.0}
    assert scaler.loss_scale == 128.0


# --------------------------------------------------------------------------- from_config
def test_from_config_returns_none_when_fp16_is_off():
    assert LossScaler.from_config(FP16Config(enabled=False)) is None


def test_from_config_loss_scale_zero_is_dynamic_at_two_to_the_initial_scale_power():
    scaler = LossScaler.from_config(FP16Config(enabled=True, loss_scale=0.0,
                                               initial_scale_power=5, loss_scale_window=3,
                                               hysteresis=1, min_loss_scale=0.5))
    assert scaler.dynamic and scaler.loss_scale == 32.0
    assert (scaler.scale_window, scaler.hysteresis, scaler.min_scale) == (3, 1, 0.5)
    assert not scaler.consecutive_hysteresis
    assert scales(scaler, [O, C, C, C]) == [16.0, 16.0, 16.0, 32.0]


def test_from_config_defaults_match_deepspeed_defaults():
    scaler = LossScaler.from_config(FP16Config(enabled=True))
    assert scaler.dynamic
    assert scaler.loss_scale == 2.0 ** 16
    assert scaler.scale_window == 1000
    assert scaler.hysteresis == scaler.cur_hysteresis == 2
    assert scaler.min_scale == 1.0
    assert scaler.consecutive_hysteresis is False


def test_from_config_passes_consecutive_hysteresis():
    scaler = LossScaler.from_config(FP16Config(enabled=True, consecutive_hysteresis=True))
    assert scaler.consecutive_hysteresis is True


def test_from_config_positive_loss_scale_is_static():
    scaler = LossScaler.from_config(FP16Config(enabled=True, loss_scale=128.0))
    assert not scaler.dynamic
    assert scales(scaler, [O, O, O, C]) == [128.0] * 4


def test_loss_scaling_without_fp16_scales_nothing_and_keeps_no_state():
    none = loss_scaling(FP16Config(enabled=False))
    assert isinstance(none, NoLossScaling) and none.loss_scale == 1.0
    loss = torch.tensor(3.0, requires_grad=True)
    assert none.scale(loss) is loss
    none.update(overflow=True)
    assert none.loss_scale == 1.0
    assert not none.skips_overflows and none.for_checkpoint() is None


def test_loss_scaling_with_fp16_is_the_scaler_and_checkpoints_itself():
    scaler = loss_scaling(FP16Config(enabled=True, loss_scale=128.0))
    assert isinstance(scaler, LossScaler) and scaler.skips_overflows
    assert scaler.for_checkpoint() is scaler
    assert scaler.scale(torch.tensor(3.0)).item() == 384.0


# --------------------------------------------------------------------------- state
@settings(max_examples=30, deadline=None)
@given(before=st.lists(st.booleans(), max_size=20), after=st.lists(st.booleans(), max_size=20),
       consecutive=st.booleans())
def test_state_dict_round_trip_continues_the_same_scale_sequence(before, after, consecutive):
    original = dynamic(init=2.0 ** 10, window=3, hysteresis=2, consecutive=consecutive,
                       min_scale=0.5)
    scales(original, before)
    state = json.loads(json.dumps(original.state_dict()))  # checkpoints store it as JSON
    restored = LossScaler(init_scale=1.0, dynamic=False)   # deliberately different
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    assert scales(restored, after) == scales(original, after)


# --------------------------------------------------------------------------- policy
Pair = namedtuple("Pair", ["x", "ids"])


def test_cast_inputs_casts_nested_float_tensors_and_keeps_integer_tensors():
    policy = PrecisionPolicy.from_names("bf16", "fp32")
    ids = torch.arange(4)
    mask = torch.ones(4, dtype=torch.bool)
    batch = {
        "x": torch.randn(2, 3),
        "pair": Pair(torch.randn(3, dtype=torch.float64), ids),
        "list": [torch.randn(1), (torch.randn(2, dtype=torch.float16), mask)],
        "n": 3, "s": "text", "none": None,
    }
    out = policy.cast_inputs(batch)
    assert set(out) == set(batch)
    assert out["x"].dtype == torch.bfloat16
    assert torch.equal(out["x"], batch["x"].to(torch.bfloat16))
    assert isinstance(out["pair"], Pair)
    assert out["pair"].x.dtype == torch.bfloat16
    assert out["pair"].ids is ids
    assert isinstance(out["list"], list) and isinstance(out["list"][1], tuple)
    assert out["list"][0].dtype == torch.bfloat16
    assert out["list"][1][0].dtype == torch.bfloat16
    assert out["list"][1][1] is mask
    assert (out["n"], out["s"], out["none"]) == (3, "text", None)
    # the input is not modified
    assert batch["x"].dtype == torch.float32


def test_cast_inputs_returns_a_tensor_already_in_the_parameter_dtype_unchanged():
    policy = PrecisionPolicy.from_names("fp16", "fp32")
    x = torch.randn(3, dtype=torch.float16)
    assert policy.cast_inputs(x) is x
    assert policy.cast_inputs(torch.arange(3)).dtype == torch.int64


def test_cast_inputs_casts_a_plain_tuple_and_an_ordered_dict():
    policy = PrecisionPolicy.from_names("fp16", "fp32")
    out = policy.cast_inputs((torch.randn(2), OrderedDict(a=torch.randn(2))))
    assert isinstance(out, tuple)
    assert out[0].dtype == torch.float16 and out[1]["a"].dtype == torch.float16


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_only_16_bit_precision_keeps_a_master_copy(name):
    policy = PrecisionPolicy.from_names(name, "fp32")
    assert policy.param_dtype == DTYPES[name]
    assert policy.master_dtype == torch.float32
    assert policy.has_master_copy == (name != "fp32")
