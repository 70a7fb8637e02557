"""DeepSpeed's gradient setters and stage 3's local accessors (``deepspeed.utils``
``safe_set_full_grad``, ``safe_update_full_grad_vectorized``, ``safe_*_local_*``), on 2
gloo ranks against a single-process reference: a gradient replaced before ``step()`` is
the one the step applies (clipping sees it too), and a local chunk is the rank's part of
the full value. DeepSpeed's optimizer attributes ride along: ``engine.allreduce_gradients()``
then ``optimizer.averaged_gradients`` (the rank's chunk of each averaged gradient) and
``fp32_groups_gradients_flat`` (each group's whole averaged gradient),
``fp16_groups`` / ``fp32_partitioned_groups_flat`` (keys of the inner optimizer's state),
stage 1-2's ``bit16_groups_flat`` (the parameters, flat) and its "Flattening param group" info
line on zerotrain's root logger (DeepSpeed's tests patch ``deepspeed.utils.logger.info``), and
``runtime.zero.unwrap_model_for_generation`` between the steps (full weights, no forward hooks
inside; training goes on after it exactly)."""
from __future__ import annotations

import pytest
import torch

import reference as R

CLIP = 0.05   # small enough that every step clips: the norm must be the replaced gradients'
# per step, the factor for the first parameter and for the others (Adam is blind to one
# factor for all; different ones per step and parameter change where it goes)
FACTORS = [(0.5, 2.0), (3.0, 0.25)]


def _job(rank: int, world: int, stage: int) -> dict:
    import zerotrain
    from zerotrain.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                                 safe_get_full_optimizer_state, safe_get_local_fp32_param,
                                 safe_get_local_grad, safe_get_local_optimizer_state,
                                 safe_set_full_grad, safe_set_local_grad,
                                 safe_update_full_grad_vectorized)

    from zerotrain.zero import unwrap_model_for_generation

    import logging

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    seen: list[str] = []
    log, keep = logging.getLogger("zerotrain"), Keep()
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(keep)
    model = R.make_model()
    try:
        engine, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=stage,
                                                                              clip=CLIP))
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    out: dict = {"local": {}, "flattening": [m for m in seen if "Flattening param group" in m]}
    assert engine.optimizer.needs_scaler() is False   # fp32: nothing to scale
    for step in range(2):
        engine.backward(engine(*R.micro_batch(step, rank, 0)))
        params = list(model.parameters())
        if step == 0:
            out["norms"] = engine.optimizer._get_norm_groups()
            engine.allreduce_gradients()
            out["averaged"] = engine.optimizer.averaged_gradients
            out["flat"] = engine.optimizer.fp32_groups_gradients_flat
        if stage == 3:   # halve the first parameter through its local chunk
            first = params[0]
            chunk = safe_get_local_grad(first)
            full = safe_get_full_grad(first).reshape(-1)
            n = chunk.numel()
            out["local"]["grad"] = torch.equal(
                chunk[: max(0, min(n, full.numel() - rank * n))], full[rank * n:(rank + 1) * n])
            safe_set_local_grad(first, chunk * FACTORS[step][0])
            params = params[1:]
        else:
            safe_set_full_grad(params[0], safe_get_full_grad(params[0]) * FACTORS[step][0])
            params = params[1:]
        safe_update_full_grad_vectorized(params, lambda g, p: g * FACTORS[step][1])
        if step == 0:
            out["norms"] += engine.optimizer._get_norm_groups()
        engine.step()
        assert engine.optimizer._global_grad_norm == engine.get_global_grad_norm() > 0
        assert engine.optimizer.averaged_gradients == {}   # none until the next backward
        if step == 0:
            masters = engine.optimizer.fp32_partitioned_groups_flat
            assert engine.optimizer.single_partition_of_fp32_groups == masters
            out["steps"] = [engine.optimizer.optimizer.state[m]["step"].item() for m in masters]
            if stage == 3:
                out["bit16"] = hasattr(engine.optimizer, "bit16_groups_flat")
            else:
                whole = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                flat = engine.optimizer.bit16_groups_flat
                out["bit16"] = (len(flat) == 1 and flat[0].grad_fn is None
                                and torch.equal(flat[0], whole))
            out["groups"] = [[n for n, p in model.named_parameters() if any(p is q for q in g)]
                             for g in engine.optimizer.fp16_groups]
            hooked = len(engine.optimizer.forward_hooks)
            with unwrap_model_for_generation(engine):
                out["unwrapped"] = (len(engine.optimizer.forward_hooks),
                                    [p.numel() for p in model.parameters()])
                with torch.no_grad():
                    model(*R.micro_batch(0, rank, 0))
            out["hooks"] = (hooked, len(engine.optimizer.forward_hooks))
    if stage == 3:
        p = next(model.parameters())
        full = safe_get_full_fp32_param(p).reshape(-1)
        avg = safe_get_full_optimizer_state(p, "exp_avg").reshape(-1)
        n = safe_get_local_fp32_param(p).numel()
        local = safe_get_local_fp32_param(p)[: max(0, min(n, full.numel() - rank * n))]
        out["local"]["param"] = torch.equal(local, full[rank * n:(rank + 1) * n])
        local = safe_get_local_optimizer_state(p, "exp_avg")[: local.numel()]
        out["local"]["exp_avg"] = torch.equal(local, avg[rank * n:(rank + 1) * n])
    else:
        with pytest.raises(zerotrain.errors.StateError, match="stage 3"):
            safe_get_local_fp32_param(next(model.parameters()))
    out["params"] = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    engine.close()
    return out


def _reference(world: int) -> tuple[dict, list]:
    """Two clipped steps of AdamW on the averaged gradients, scaled by FACTORS; and the
    first step's gradient norm before and after the scaling."""
    model = R.make_model()
    opt = R.adamw(model.parameters())
    for step in range(2):
        grads = R.summed_gradients(model, step, world)
        if step == 0:
            norms = [torch.linalg.vector_norm(torch.cat([g.reshape(-1) / world for g in grads]))]
        for i, (p, g) in enumerate(zip(model.parameters(), grads)):
            p.grad = g / world * FACTORS[step][0 if i == 0 else 1]
        if step == 0:
            norms.append(torch.linalg.vector_norm(
                torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


@pytest.mark.parametrize("stage", [1, 3])
def test_replaced_gradients_are_the_ones_stepped_and_local_chunks_are_the_ranks(worlds,
                                                                                stage):
    expected, norms = _reference(2)
    means = [g / 2 for g in R.summed_gradients(R.make_model(), 0, 2)]
    full_numel = [p.numel() for p in R.make_model().parameters()]
    for rank, res in enumerate(worlds.run(2, _job, stage)):
        where = f"stage {stage} rank {rank}"
        assert torch.allclose(torch.stack(res["norms"]), torch.stack(norms), rtol=1e-5), where
        assert R.max_diff(res["params"], expected) < 1e-6, where
        assert all(res["local"].values()), (where, res["local"])
        # averaged_gradients: {group 0: the rank's chunk of each first-step mean gradient}
        assert list(res["averaged"]) == [0], where
        for p, mean, chunk in zip(R.make_model().parameters(), means, res["averaged"][0]):
            n = -(-p.numel() // 2)
            padded = torch.cat([mean.reshape(-1), mean.new_zeros(2 * n - p.numel())])
            assert torch.allclose(chunk, padded[rank * n:(rank + 1) * n], atol=1e-7), where
        flat = torch.cat([m.reshape(-1) for m in means])   # one group: every parameter
        assert len(res["flat"]) == 1 and torch.allclose(res["flat"][0], flat, atol=1e-7), where
        names = sorted(n for n, _ in R.make_model().named_parameters())
        assert sorted(sum(res["groups"], [])) == names, where   # each parameter once
        assert res["steps"] == [1.0] * len(res["groups"]), where
        assert res["bit16"] == (stage != 3), where   # stage 3 has none, as DeepSpeed's
        shard = 4 * sum(-(-n // 2) for n in full_numel)   # fp32: each parameter's half
        assert res["flattening"] == ([] if stage == 3 else [
            f"Flattening param group 0 ({shard} bytes) on cpu (sufficient memory)"]), where
        full = [p.numel() for p in R.make_model().parameters()]
        assert res["unwrapped"] == (0, full), where
        assert res["hooks"][0] == res["hooks"][1] and (res["hooks"][0] > 0) == (stage == 3)
