"""Mixture-of-experts models on 2 ranks whose tokens route differently: Hugging Face's at
stage 3, their sparse MoE block a leaf module (DeepSpeed 0.19's default
``zero_optimization.leaf_module`` classes, or declared with ``set_z3_leaf_modules``), train
like stage 0; DeepSpeed's MoE layer (``zerotrain.moe``) trains at stages 0-3 like the
single-process reference of the ranks' micro-batches."""
import pytest
import torch

import moe_models as M
import reference as R

pytestmark = pytest.mark.slow

STEPS = 3
LAYER_STEPS = 2   # DeepSpeed's MoE layer: 5 engines of 2 steps


def _model(family):
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=1,
                  max_position_embeddings=32)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_local_experts=4, **common))
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_experts=4, moe_intermediate_size=12, decoder_sparse_step=1, mlp_only_layers=[],
        **common))


def _train(rank, family, stage, declare):
    import zerotrain
    from zerotrain.utils import get_z3_leaf_modules, set_z3_leaf_modules, z3_leaf_parameter
    model = _model(family)
    block = type(model.model.layers[0].mlp)
    config = R.engine_config(stage=stage)
    if declare:   # as Accelerate's plugin does; the config's defaults are switched off
        set_z3_leaf_modules(model, [block])
        config["zero_optimization"]["leaf_module"] = {"classes": []}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, 64, (2, 8), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    leaves = [type(m) for m in get_z3_leaf_modules(model)]
    leaf_params = sum(z3_leaf_parameter(p) for p in model.parameters())
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return weights, leaves, leaf_params, block


def _runs(rank, world):
    out = {}
    for family in ("mixtral", "qwen3_moe"):
        out[family] = {(stage, declare): _train(rank, family, stage, declare)
                       for stage, declare in ((0, False), (3, False), (3, True))}
    return out


def test_hf_moe_blocks_as_leaves_train_at_stage3_like_stage0(worlds):
    for rank, out in enumerate(worlds.run(2, _runs)):
        for family, runs in out.items():
            base = runs[(0, False)][0]
            for case in ((3, False), (3, True)):
                weights, leaves, leaf_params, block = runs[case]
                assert leaves == [block, block], (family, case, leaves)
                assert leaf_params > 0, (family, case)
                assert R.max_diff(weights, base) < 1e-4, (family, case, rank)


def test_estimate_counts_a_leaf_module_whole_as_the_largest_layer():
    from zerotrain.estimate.models import shape_from_module
    from zerotrain.utils import set_z3_leaf_modules
    model = _model("mixtral")
    block = type(model.model.layers[0].mlp)
    before = shape_from_module(model).largest_layer_params
    set_z3_leaf_modules(model, [block])
    after = shape_from_module(model).largest_layer_params
    leaf = sum(p.numel() for p in model.model.layers[0].mlp.parameters())
    assert after == max(before, leaf) and leaf > before


def _train_moe_layer(rank, world):
    import zerotrain
    from zerotrain.moe.utils import split_params_into_different_moe_groups_for_optimizer
    out = {}
    for stage, init in ((0, False), (1, False), (2, False), (3, False), (3, True)):
        config = R.engine_config(stage=stage, micro_size=2)
        with zerotrain.zero.Init(config_dict_or_path=config, enabled=init):
            model = M.make_layer_model()   # under zero.Init: the experts copied partitioned
        params = model.parameters()
        if stage % 2:   # the groups a script makes (DeepSpeed's tutorial); else the engine's
            params = split_params_into_different_moe_groups_for_optimizer(
                {"params": list(params), "name": "dense"})
        engine, *_ = zerotrain.initialize(model=model, model_parameters=params, config=config)
        for step in range(LAYER_STEPS):
            torch.manual_seed(step)   # the gate's random draws: the same seed on every rank
            engine.backward(engine(*M.layer_batch(step, rank)))
            engine.step()
        groups = [(g.get("name"), g.get("moe", False)) for g in engine.optimizer.param_groups]
        with zerotrain.zero.GatheredParameters(list(model.parameters())):
            out[stage, init] = ({n: p.detach().clone() for n, p in model.named_parameters()}, groups)
        engine.close()
    return out


def test_deepspeed_moe_layer_trains_at_every_stage_like_the_single_process_reference(worlds):
    reference = M.layer_reference(steps=LAYER_STEPS, world=2)
    start = M.make_layer_model().state_dict()
    assert max((start[n] - reference[n]).abs().max() for n in reference) > 1e-3   # it trains
    for rank, out in enumerate(worlds.run(2, _train_moe_layer)):
        assert len(out) == 5
        for (stage, init), (weights, groups) in out.items():
            assert R.max_diff(weights, reference) < 1e-5, (stage, init, rank)
            dense = "dense" if stage % 2 else "dense-params"
            assert groups == [(dense, False), ("ep_size_1", True)], (stage, groups)
