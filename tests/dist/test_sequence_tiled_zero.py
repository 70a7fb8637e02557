"""Tiled MLP and tiled logits+loss train like the untiled model through zerotrain.initialize
on 2 gloo ranks, at stages 0, 2 and 3, fp32 and bf16, with gradient accumulation.

The weights inside a tile sum their gradients in ``.grad`` (``ds_grad_is_ready`` False
until the last tile) and the stage reduces the sum once, so the losses and the weights
after the steps differ from the untiled run's only by the order of summation (SGD: the difference is the learning rate times the gradients'). At stage 3
the tiles do not gather again: a step's all-gathers are no more than the untiled step's.
"""
import pytest
import torch

import reference as R
import tiled_model as T

STEPS = 3


def _train(rank, stage, precision, mlp, loss, ga):
    import zerotrain
    torch.manual_seed(0)
    model = T.TinyLM(mlp, loss)
    config = R.engine_config(stage=stage, precision=precision, micro_size=2, ga=ga,
                             optimizer={"type": "SGD", "params": {"lr": 0.5}})
    engine, *_ = zerotrain.initialize(model=model, config=config)
    engine.comm.ledger.reset()
    losses = []
    for step in range(STEPS):
        for micro in range(ga):
            ids, labels = T.batch(10 * step + micro, rank)
            out = engine(ids, labels)
            engine.backward(out)
            engine.step()
            losses.append(out.item())
    calls = engine.comm.ledger.snapshot()["calls"]
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    ready = all(getattr(p, "ds_grad_is_ready", True) for p in model.parameters())
    return {"losses": losses, "params": params, "calls": calls, "ready": ready}


def _compare(rank, world, cases):
    out = []
    for stage, precision, ga in cases:
        plain = _train(rank, stage, precision, 1, 1, ga)
        tiled = _train(rank, stage, precision, 4, 3, ga)
        out.append({"case": (stage, precision, ga), "plain": plain["losses"],
                    "tiled": tiled["losses"], "diff": R.max_diff(plain["params"], tiled["params"]),
                    "calls": (plain["calls"], tiled["calls"]), "ready": tiled["ready"]})
    return out


@pytest.mark.slow
def test_tiled_training_equals_untiled_at_every_stage(worlds):
    cases = [(3, "fp32", 2), (3, "bf16", 1), (2, "fp32", 2), (0, "fp32", 1)]
    for res in worlds.run(2, _compare, cases):
        for case in res:
            stage, precision, _ = case["case"]
            # the loss is a sum of the tiles' sums: the order of summation only
            assert abs(case["plain"][0] - case["tiled"][0]) <= 1e-6 * case["plain"][0], case
            assert case["ready"], case
            if precision == "fp32":
                assert case["diff"] < 1e-6, case
                assert max(abs(a - b) for a, b in zip(case["plain"], case["tiled"])) < 1e-5
            else:   # bf16 weights: a rounding step of the largest weight (~0.5) at most
                assert case["diff"] <= 2 ** -8, case
            if stage == 3:
                plain, tiled = case["calls"]
                assert tiled["all_gather"] <= plain["all_gather"], case
                assert tiled["reduce_scatter"] == plain["reduce_scatter"], case
