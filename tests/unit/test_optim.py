"""Optimizers over flat shards: building, re-targeting, and why flat stepping is exact.

The design steps one flat tensor per group (a rank's shard) instead of the module's
parameters; that is only correct because Adam/AdamW/SGD are elementwise, so stepping the
concatenation must give bitwise the values of stepping each parameter.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

try:
    import zerotrain.optim  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from zerotrain.errors import ConfigError
from zerotrain.optim import (ZeroOptimizer, build_optimizer, param_groups_from,
                             retarget_optimizer)

CPU = torch.device("cpu")
SIZES = [1, 7, 33, 64, 5, 129, 1]  # odd sizes: vectorised bodies and scalar tails


def shard_groups(*sizes: int) -> list[dict]:
    return [{"params": [torch.zeros(n, requires_grad=True)]} for n in sizes]


# --------------------------------------------------------------------------- build_optimizer
def test_adam_means_adamw_by_default():
    opt = build_optimizer("Adam", {"lr": 1e-3, "weight_decay": 0.1}, shard_groups(4),
                          device=CPU)
    assert type(opt) is torch.optim.AdamW


def test_adam_with_adam_w_mode_false_is_plain_adam_with_l2_weight_decay():
    opt = build_optimizer("Adam", {"lr": 1e-3, "weight_decay": 0.1, "adam_w_mode": False},
                          shard_groups(4), device=CPU)
    assert type(opt) is torch.optim.Adam
    assert opt.param_groups[0]["weight_decay"] == 0.1


def test_adamw_is_adamw_even_with_adam_w_mode_false():
    opt = build_optimizer("AdamW", {"lr": 1e-3, "adam_w_mode": False}, shard_groups(4),
                          device=CPU)
    assert type(opt) is torch.optim.AdamW


def test_adam_hyperparameters_reach_the_optimizer_and_deepspeed_only_keys_are_dropped():
    opt = build_optimizer("Adam", {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6,
                                   "weight_decay": 0.05, "torch_adam": True,
                                   "bias_correction": True}, shard_groups(3), device=CPU)
    group = opt.param_groups[0]
    assert group["lr"] == 0.01
    assert group["betas"] == (0.8, 0.9)
    assert group["eps"] == 1e-6
    assert group["weight_decay"] == 0.05


def test_adam_on_cpu_uses_no_fused_kernel():
    opt = build_optimizer("Adam", {"lr": 0.01}, shard_groups(3), device=CPU)
    assert not opt.param_groups[0].get("fused")


def test_sgd_without_lr_raises_config_error_naming_the_key():
    with pytest.raises(ConfigError) as info:
        build_optimizer("SGD", {"momentum": 0.9}, shard_groups(3), device=CPU)
    assert info.value.path == "optimizer.params.lr"


def test_sgd_keeps_its_hyperparameters():
    opt = build_optimizer("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
                          shard_groups(3), device=CPU)
    assert type(opt) is torch.optim.SGD
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.9, 0.01)


def test_unknown_optimizer_type_raises_config_error():
    with pytest.raises(ConfigError) as info:
        build_optimizer("Lamb", {"lr": 0.1}, shard_groups(3), device=CPU)
    assert info.value.path == "optimizer.type"


@pytest.mark.parametrize("type_name", ["Adam", "AdamW", "SGD"])
def test_per_group_hyperparameters_override_the_config_defaults(type_name):
    groups = [{"params": [torch.zeros(3, requires_grad=True)], "weight_decay": 0.0},
              {"params": [torch.zeros(5, requires_grad=True)], "lr": 0.5}]
    opt = build_optimizer(type_name, {"lr": 0.01, "weight_decay": 0.1}, groups, device=CPU)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.5]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1]
    assert opt.param_groups[0]["params"][0] is groups[0]["params"][0]


# --------------------------------------------------------------------------- retarget
def test_retarget_keeps_the_optimizer_object_and_its_group_hyperparameters():
    a, b, c = (nn.Parameter(torch.randn(n)) for n in (3, 4, 5))
    opt = torch.optim.AdamW([{"params": [a, b], "lr": 0.1, "weight_decay": 0.0},
                             {"params": [c], "lr": 0.2, "betas": (0.5, 0.6)}],
                            weight_decay=0.3)
    before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    shards = [[torch.zeros(4, requires_grad=True)], [torch.zeros(2, requires_grad=True)]]
    result = retarget_optimizer(opt, shards)
    assert result is opt
    assert [g["params"] for g in opt.param_groups] == shards
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before


def test_retargeted_optimizer_steps_the_shards():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.5)
    shard = torch.ones(2, requires_grad=True)
    retarget_optimizer(opt, [[shard]])
    shard.grad = torch.full((2,), 2.0)
    opt.step()
    assert shard.tolist() == [0.0, 0.0]


def test_an_lr_scheduler_built_before_retarget_still_drives_the_shards_lr():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    retarget_optimizer(opt, [[torch.zeros(2, requires_grad=True)]])
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_retarget_refuses_an_optimizer_that_already_has_state():
    p = nn.Parameter(torch.randn(3))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    with pytest.raises(ConfigError, match="already holds state"):
        retarget_optimizer(opt, [[torch.zeros(3, requires_grad=True)]])
    assert opt.param_groups[0]["params"][0] is p


def test_retarget_needs_one_shard_list_per_group():
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.ones(1))]},
                           {"params": [nn.Parameter(torch.ones(1))]}], lr=0.1)
    with pytest.raises(ValueError):
        retarget_optimizer(opt, [[torch.zeros(1)]])


# --------------------------------------------------------------------------- param groups
def test_param_groups_from_accepts_an_iterator_of_tensors():
    model = nn.Linear(3, 2)
    groups = param_groups_from(model.parameters())
    assert len(groups) == 1
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in model.parameters()]


def test_param_groups_from_accepts_group_dicts_and_keeps_their_options():
    a, b = nn.Parameter(torch.randn(2)), nn.Parameter(torch.randn(3))
    user_groups = [{"params": (p for p in [a]), "weight_decay": 0.0}, {"params": [b], "lr": 3.0}]
    groups = param_groups_from(user_groups)
    assert groups == [{"params": [a], "weight_decay": 0.0}, {"params": [b], "lr": 3.0}]
    assert groups[0]["params"][0] is a


def test_param_groups_from_does_not_mutate_the_callers_dicts():
    a = nn.Parameter(torch.randn(2))
    user = {"params": (a,), "lr": 1.0}
    param_groups_from([user])
    assert user == {"params": (a,), "lr": 1.0}


def test_param_groups_from_rejects_a_parameter_in_two_groups():
    a, b = nn.Parameter(torch.randn(2)), nn.Parameter(torch.randn(3))
    with pytest.raises(ConfigError, match="two groups"):
        param_groups_from([{"params": [a, b]}, {"params": [a]}])


def test_param_groups_from_rejects_a_parameter_listed_twice():
    a = nn.Parameter(torch.randn(2))
    with pytest.raises(ConfigError):
        param_groups_from([a, a])


@pytest.mark.parametrize("items", [[], [{"params": []}, nn.Parameter(torch.ones(1))],
                                   [("name", nn.Parameter(torch.ones(1)))]])
def test_param_groups_from_rejects_empty_or_mixed_input(items):
    with pytest.raises(ConfigError):
        param_groups_from(items)


@pytest.mark.parametrize("shape", [(3, 4), ()])
def test_param_groups_from_accepts_a_single_tensor_as_a_groups_params(shape):
    w = nn.Parameter(torch.randn(shape))
    groups = param_groups_from([{"params": w, "lr": 0.1}])
    assert len(groups[0]["params"]) == 1 and groups[0]["params"][0] is w


# --------------------------------------------------------------------------- flat == per-param
def _adamw_pair(weight_decay: float, foreach: bool, amsgrad: bool = False):
    gen = torch.Generator().manual_seed(1234)
    values = [torch.randn(n, generator=gen) for n in SIZES]
    per_param = [v.clone().requires_grad_() for v in values]
    flat = torch.cat(values).requires_grad_()
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                  amsgrad=amsgrad, foreach=foreach)
    return gen, per_param, flat, torch.optim.AdamW(per_param, **kwargs), \
        torch.optim.AdamW([flat], **kwargs)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_over_one_flat_tensor_is_bitwise_per_parameter_adamw(foreach, amsgrad):
    gen, per_param, flat, opt_p, opt_f = _adamw_pair(0.1, foreach, amsgrad)
    for _ in range(5):
        grads = [torch.randn(n, generator=gen) * 10 for n in SIZES]
        for p, g in zip(per_param, grads):
            p.grad = g.clone()
        flat.grad = torch.cat(grads)
        opt_p.step()
        opt_f.step()
        assert torch.equal(flat.detach(), torch.cat([p.detach() for p in per_param]))
    state_f = opt_f.state[flat]
    for key in ("exp_avg", "exp_avg_sq"):
        per = torch.cat([opt_p.state[p][key] for p in per_param])
        assert torch.equal(state_f[key], per), key


def test_build_optimizer_adam_over_flat_shard_matches_per_parameter_steps():
    """The same through build_optimizer, with two groups and a per-group weight decay."""
    gen = torch.Generator().manual_seed(7)
    sizes_a, sizes_b = [5, 1, 17], [64, 3]
    vals_a = [torch.randn(n, generator=gen) for n in sizes_a]
    vals_b = [torch.randn(n, generator=gen) for n in sizes_b]
    params = {"lr": 3e-3, "weight_decay": 0.2, "betas": [0.9, 0.999]}
    per = build_optimizer("Adam", params, [
        {"params": [v.clone().requires_grad_() for v in vals_a]},
        {"params": [v.clone().requires_grad_() for v in vals_b], "weight_decay": 0.0}],
        device=CPU)
    flat = build_optimizer("Adam", params, [
        {"params": [torch.cat(vals_a).requires_grad_()]},
        {"params": [torch.cat(vals_b).requires_grad_()], "weight_decay": 0.0}], device=CPU)
    for _ in range(4):
        for g_per, g_flat in zip(per.param_groups, flat.param_groups):
            grads = [torch.randn(p.numel(), generator=gen) for p in g_per["params"]]
            for p, g in zip(g_per["params"], grads):
                p.grad = g.clone()
            g_flat["params"][0].grad = torch.cat(grads)
        per.step()
        flat.step()
    for g_per, g_flat in zip(per.param_groups, flat.param_groups):
        assert torch.equal(g_flat["params"][0].detach(),
                           torch.cat([p.detach() for p in g_per["params"]]))


# --------------------------------------------------------------------------- ZeroOptimizer
def test_zero_optimizer_shares_param_groups_and_refuses_a_direct_step():
    inner = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    wrapped = ZeroOptimizer(inner)
    wrapped.param_groups[0]["lr"] = 0.7
    assert inner.param_groups[0]["lr"] == 0.7
    with pytest.raises(Exception, match="engine.step"):
        wrapped.step()


def test_needs_scaler_is_true_for_fp16_only():
    """DeepSpeed's ``optimizer.needs_scaler()``: a direct ``loss.backward()`` needs
    ``engine.scale(loss)`` under fp16's loss scaling, never under bf16 or fp32."""
    from zerotrain.engine.optimizer_views import OptimizerViews

    class _Engine:
        def __init__(self, precision):
            self.precision = precision

        def fp16_enabled(self):
            return self.precision == "fp16"

    opt = ZeroOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))
    for precision, expected in (("fp16", True), ("bf16", False), ("fp32", False)):
        engine = _Engine(precision)
        opt.views = OptimizerViews(engine)
        assert opt.needs_scaler() is expected, precision
