"""Muon's config, flags and halves as DeepSpeed 0.19.8 reads them (no processes)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.config import load_config
from zerotrain.errors import ConfigError


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 5), nn.LayerNorm(5))


def test_muon_config_type_and_its_keys_are_accepted():
    cfg = load_config({"train_batch_size": 2, "optimizer": {"type": "muon", "params": {
        "lr": 1e-3, "muon_lr": 0.02, "momentum": 0.9, "ns_method": "standard",
        "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}}}, world_size=1)
    assert cfg.optimizer.type == "Muon"
    assert cfg.optimizer.params["muon_lr"] == 0.02
    with pytest.raises(ConfigError, match="ns_method"):
        load_config({"train_batch_size": 2, "optimizer": {"type": "Muon", "params": {
            "ns_method": "svd"}}}, world_size=1)


def test_flags_follow_deepspeed_and_halves_take_muon_lr_and_group_overrides():
    from zerotrain.muon import muon_param_groups, tag_model
    model = _model()
    model[1].weight.use_muon = False   # overwritten, as DeepSpeed's set_optimizer_flags does
    tag_model(model)
    flags = {n: p.use_muon for n, p in model.named_parameters()}
    assert flags == {"0.weight": True, "1.weight": True, "1.bias": False,
                     "2.weight": False, "2.bias": False}
    groups = muon_param_groups(
        [{"params": [model[1].weight, model[1].bias]},
         {"params": [model[2].weight, model[2].bias], "weight_decay": 0.0}],
        {"lr": 1e-3, "muon_lr": 0.05, "weight_decay": 0.1})
    summary = [(g["name"], g["use_muon"], g["lr"], g["weight_decay"], len(g["params"]))
               for g in groups]
    assert summary == [("group0-muon-params", True, 0.05, 0.1, 1),
                       ("group0-adam-params", False, 1e-3, 0.1, 1),
                       ("group1-adam-params", False, 1e-3, 0.0, 2)]
    assert groups[0]["momentum"] == 0.95 and groups[0]["ns_method"] == "gram"
    assert groups[1]["betas"] == (0.9, 0.95) and groups[1]["eps"] == 1e-10


def test_a_parameter_without_the_flag_is_named():
    from zerotrain.muon import muon_param_groups
    model = _model()
    stray = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ConfigError, match=r"needs every parameter tagged with use_muon, "
                                          r"and 1 are not: extra\.weight"):
        muon_param_groups([stray], {}, {id(stray): "extra.weight"})
    del model


def test_torch_muon_is_an_accepted_client_optimizer():
    from zerotrain.optim import check_client_optimizer
    check_client_optimizer(torch.optim.Muon([nn.Parameter(torch.zeros(2, 2))]),
                           allow_untested=False)


def test_newton_schulz_matches_torch_muon_orthogonality():
    """DeepSpeed's default Gram iteration and its quintic one give a near-orthogonal matrix
    with DeepSpeed's aspect-ratio scale (sqrt(rows / cols) for a tall one)."""
    from zerotrain.muon.newton_schulz import deepspeed_orthogonalize
    g = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    for method in ("gram", "standard"):
        u = deepspeed_orthogonalize(g, ns_method=method) / (12 / 5) ** 0.5
        s = torch.linalg.svdvals(u.float())
        assert 0.5 < s.min() and s.max() < 1.5, (method, s)


@pytest.mark.parametrize("extra, key", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                              "nvme_path": "/tmp"}}},
     "offload_optimizer.device"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "dpu": True}}},
     "offload_optimizer.dpu"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                              "speculative": True}}},
     "offload_optimizer.speculative"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
               "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}},
     "bf16.bf16_master_weights_and_grads")])
def test_what_muon_cannot_run_with_is_refused_by_name(extra, key):
    from zerotrain.muon.setup import check_and_tag
    cfg = load_config(dict({"train_batch_size": 2, "optimizer": {"type": "Muon"}}, **extra),
                      world_size=1)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_and_tag(cfg, None, _model())
