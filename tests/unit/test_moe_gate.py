"""DeepSpeed's MoE layer (``zerotrain.moe``): the gate's capacity, dropping and auxiliary
loss against hand computations, the layer's output from the experts' own, and the
optimizer groups DeepSpeed's helpers make of its parameters."""
import pytest
import torch

from zerotrain.errors import ConfigError
from zerotrain.moe.gate import TopKGate, capacity_for, top1_routing, top2_routing
from zerotrain.moe.layer import MoE
from zerotrain.moe.utils import (configure_moe_param_groups, has_moe_layers, is_moe_param,
                                 split_params_into_different_moe_groups_for_optimizer)

# 8 tokens over 2 experts: tokens 0-5 prefer expert 0, tokens 6-7 expert 1
LOGITS = torch.tensor([[2.0, 0.0], [1.0, 0.5], [3.0, -1.0], [0.5, 0.0],
                       [1.5, 0.0], [2.5, 1.0], [0.0, 1.0], [-1.0, 2.0]])


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """(torch.testing.assert_close's first call imports for seconds.)"""
    assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a, b)


def test_capacity_is_tokens_per_expert_times_factor_rounded_up_at_least_min_capacity():
    assert capacity_for(10, 4, 1.0, 0) == 3        # ceil(2.5)
    assert capacity_for(10, 4, 1.0, 4) == 4        # min_capacity wins
    assert capacity_for(10, 4, 2.0, 0) == 5
    assert capacity_for(8, 2, 0.5, 1) == 2


def test_top1_drops_an_experts_tokens_past_capacity_and_the_aux_loss_is_by_hand():
    r = top1_routing(LOGITS, capacity_factor=1.0, min_capacity=0, use_rts=False)
    assert r.capacity == 4 and r.exp_counts.tolist() == [6, 2]   # counted before dropping
    # without RTS an expert keeps its first tokens: 0-3 fill expert 0, 4 and 5 are dropped
    assert r.experts.tolist() == [[0, 0, 0, 0, -1, -1, 1, 1]]
    assert r.slots.tolist() == [[0, 1, 2, 3, 0, 0, 0, 1]]
    probs = torch.softmax(LOGITS, dim=1)
    kept = torch.tensor([1.0, 1, 1, 1, 0, 0, 1, 1])
    expected_w = probs.max(dim=1).values * kept
    _close(r.weights[0], expected_w)
    # l_aux = E * sum_e(mean probability of e * fraction of tokens whose choice is e)
    expected = 2 * (probs[:, 0].mean() * 6 / 8 + probs[:, 1].mean() * 2 / 8)
    _close(r.l_aux, expected)


def test_top1_random_token_selection_keeps_capacity_tokens_chosen_by_the_seed():
    def kept(seed):
        torch.manual_seed(seed)
        return top1_routing(LOGITS, capacity_factor=1.0, min_capacity=0).experts[0]
    first = kept(0)
    assert (first[:6] == 0).sum() == 4 and (first[:6] == -1).sum() == 2
    assert first[6:].tolist() == [1, 1]
    assert torch.equal(first, kept(0))                       # deterministic given the seed
    assert any(not torch.equal(first, kept(s)) for s in range(1, 6))   # and random


def test_top1_without_dropping_used_token_and_min_capacity():
    r = top1_routing(LOGITS, capacity_factor=1.0, min_capacity=0, drop_tokens=False)
    assert r.capacity == 6 and (r.experts >= 0).all()
    used = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0])
    r = top1_routing(LOGITS, capacity_factor=1.0, min_capacity=0, used_token=used,
                     use_rts=False)
    assert r.exp_counts.tolist() == [5, 1]
    assert r.experts.tolist() == [[0, 0, -1, 0, 0, -1, 1, -1]]   # 2, 7 unused; 5 over
    with pytest.raises(ConfigError, match="min_capacity=9"):
        top1_routing(LOGITS, capacity_factor=1.0, min_capacity=9)


def test_top2_fills_first_choices_then_second_and_renormalises_the_two_weights():
    r = top2_routing(LOGITS, capacity_factor=0.5, min_capacity=0, second_sampling=False)
    # capacity ceil(8 / 2 * 0.5 * 2) = 4: expert 0's first choices 0-3 fit, 4-5 do not;
    # expert 1 takes its first choices 6-7 in slots 0-1, then second choices 0-1 in 2-3
    assert r.capacity == 4 and r.exp_counts.tolist() == [8, 8]
    assert r.experts.tolist() == [[0, 0, 0, 0, -1, -1, 1, 1], [1, 1, -1, -1, -1, -1, -1, -1]]
    assert r.slots[1, :2].tolist() == [2, 3]
    assert torch.allclose(r.weights[:, :2].sum(dim=0), torch.ones(2))
    assert torch.equal(r.weights[0, 2:4], torch.ones(2))   # one route left: all its weight
    probs = torch.softmax(LOGITS, dim=1)
    expected = 4 * torch.mean(probs.mean(dim=0) * torch.tensor([6 / 8, 2 / 8]))
    _close(r.l_aux, expected)


def test_layer_output_is_the_gate_weighted_expert_output_and_zero_for_a_dropped_token():
    torch.manual_seed(0)
    expert = torch.nn.Linear(2, 2)
    moe = MoE(hidden_size=2, expert=expert, num_experts=2, k=1, capacity_factor=1.0,
              min_capacity=0, use_rts=False)
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(torch.eye(2))   # logits = tokens
    out, l_aux, counts = moe(LOGITS.view(2, 4, 2))
    assert out.shape == (2, 4, 2) and counts.tolist() == [6, 2]
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    probs = torch.softmax(LOGITS, dim=1)
    for t, e in enumerate([0, 0, 0, 0, None, None, 1, 1]):
        want = (torch.zeros(2) if e is None
                else experts[e](LOGITS[t]) * probs[t, e])
        _close(out.view(8, 2)[t], want)
    (out.sum() + l_aux).backward()
    assert moe.deepspeed_moe.gate.wg.weight.grad.abs().sum() > 0   # through weights and l_aux
    assert expert.weight.grad is None                             # the copies train, not it


def test_residual_mixes_the_dense_expert_by_a_learned_coefficient():
    torch.manual_seed(0)
    expert = torch.nn.Linear(4, 4)
    moe = MoE(hidden_size=4, expert=expert, num_experts=2, use_residual=True, min_capacity=0)
    x = torch.randn(3, 4)
    out, _, _ = moe(x)
    moe_only = moe.deepspeed_moe(x)
    mix = torch.softmax(moe.coefficient(x), dim=-1)
    _close(out, moe_only * mix[:, :1] + expert(x) * mix[:, 1:])


def test_expert_parameters_are_marked_and_split_into_their_own_groups():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4),
                                MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=3))
    assert has_moe_layers(model) == (True, 3)
    experts = [p for p in model.parameters() if is_moe_param(p)]
    assert len(experts) == 6 and {p.group_name for p in experts} == {"ep_size_1"}
    groups = configure_moe_param_groups(list(model.parameters()))
    assert [(g["name"], g.get("moe", False), len(g["params"])) for g in groups] == [
        ("dense-params", False, 3), ("ep_size_1", True, 6)]
    assert groups[1]["params"] == experts
    # max_group_size cuts each expert group, options copied into every piece
    split = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "all", "lr": 0.5}, max_group_size=20)
    assert [len(g["params"]) for g in split] == [3, 2, 2, 2]
    assert all(g["lr"] == 0.5 for g in split) and [g["name"] for g in split[1:]] == [
        "ep_size_1"] * 3


def test_bad_arguments_name_the_argument():
    with pytest.raises(ConfigError, match="MoE.k"):
        TopKGate(4, 2, k=3)
    with pytest.raises(ConfigError, match="noisy_gate_policy"):
        TopKGate(4, 2, noisy_gate_policy="Gumbel")
