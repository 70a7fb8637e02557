"""DeepSpeed's helper API as training scripts call it, on 2 gloo ranks: ``deepspeed.comm``
functions, ``deepspeed.utils`` (log_dist, safe_get/set_full_*) and the ZeRO-3 parameter
attributes (ds_id, ds_status, ds_numel, ds_tensor), checked against a single-process
reference."""
from __future__ import annotations

import logging

import torch

import reference as R


def _comm_job(rank: int, world: int) -> dict:
    import zerotrain.comm as dist   # the way scripts import deepspeed.comm

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    mx = torch.tensor([float(rank)])
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=1)
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    dist.barrier()
    return {"initialized": dist.is_initialized(), "rank": dist.get_rank(),
            "world": dist.get_world_size(), "local": dist.get_local_rank(),
            "sum": t.item(), "max": mx.item(), "bcast": b.tolist(),
            "gathered": [g.tolist() for g in gathered]}


def test_deepspeed_comm_functions_act_on_the_world(worlds):
    for rank, res in enumerate(worlds.run(2, _comm_job)):
        assert res["initialized"] and res["rank"] == rank and res["world"] == 2
        assert res["local"] == rank              # from LOCAL_RANK
        assert res["sum"] == 3.0 and res["max"] == 1.0 and res["bcast"] == [1.0] * 3
        assert res["gathered"] == [[0.0, 0.0], [1.0, 1.0]]


def _safe_job(rank: int, world: int, stage: int) -> dict:
    import zerotrain
    from zerotrain.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                                 safe_get_full_optimizer_state, safe_set_full_fp32_param)

    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=stage))
    R.train_engine(engine, steps=2, rank=rank, ga=1)
    engine.backward(engine(*R.micro_batch(2, rank, 0)))
    out = {"grads": {}, "params": {}, "exp_avg": {}, "step": None}
    for name, p in model.named_parameters():
        out["grads"][name] = safe_get_full_grad(p)
        out["params"][name] = safe_get_full_fp32_param(p)
        out["exp_avg"][name] = safe_get_full_optimizer_state(p, "exp_avg")
    engine.step()
    assert safe_get_full_grad(model.hidden.weight) is None   # nothing since the step
    new = torch.full(tuple(R.make_model().hidden.weight.shape), 0.5)
    safe_set_full_fp32_param(model.hidden.weight, new)
    out["after_set"] = safe_get_full_fp32_param(model.hidden.weight)
    with zerotrain.zero.GatheredParameters([model.hidden.weight]):
        out["module_after_set"] = model.hidden.weight.detach().clone()
    engine.close()
    return out


def _reference_with_third_gradient(world: int) -> tuple[dict, dict, dict]:
    """Weights after two steps, their exp_avg, and the third step's averaged gradient."""
    model = R.make_model()
    opt = R.adamw(model.parameters())
    for step in range(3):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            model(*R.micro_batch(step, rank, 0)).backward()
            for g, p in zip(grads, model.parameters()):
                g.add_(p.grad)
        if step == 2:
            break
        for p, g in zip(model.parameters(), grads):
            p.grad = g / world
        opt.step()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    exp_avg = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    return params, exp_avg, {n: g / world for n, g in zip(names, grads)}


def test_safe_get_and_set_full_values_match_the_reference_at_every_stage(worlds):
    params, exp_avg, grads = _reference_with_third_gradient(2)
    for stage in (0, 1, 2, 3):
        for rank, res in enumerate(worlds.run(2, _safe_job, stage)):
            where = f"stage {stage} rank {rank}"
            assert R.max_diff(res["params"], params) < 1e-5, where
            assert R.max_diff(res["exp_avg"], exp_avg) < 1e-5, where
            assert R.max_diff(res["grads"], grads) < 1e-5, where
            assert torch.equal(res["after_set"], torch.full_like(res["after_set"], 0.5)), where
            assert torch.equal(res["module_after_set"], res["after_set"]), where


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _log_and_status_job(rank: int, world: int) -> dict:
    import zerotrain
    from zerotrain.utils import log_dist
    from zerotrain.zero import ZeroParamStatus

    handler = _Records()
    logger = logging.getLogger("zerotrain")
    logger.addHandler(handler)
    try:
        log_dist("only on one", ranks=[1])
        log_dist("everywhere", ranks=[-1])
        log_dist("nowhere")   # DeepSpeed's rule: no ranks, a process group: no log
    finally:
        logger.removeHandler(handler)
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=3))
    p = model.hidden.weight
    outside = p.ds_status
    with zerotrain.zero.GatheredParameters([p]):
        inside = p.ds_status
        full_shape = tuple(p.shape)
    ids = [q.ds_id for q in model.parameters()]
    res = {"messages": handler.messages, "outside": outside, "inside": inside,
           "after": p.ds_status, "ids": ids, "numel": p.ds_numel, "full_shape": full_shape,
           "chunk": p.ds_tensor.numel(), "not_available": ZeroParamStatus.NOT_AVAILABLE}
    R.train_engine(engine, steps=1, rank=rank, ga=1)
    res["after_training"] = {q.ds_status for q in model.parameters()}
    engine.close()
    return res


def test_log_dist_ranks_and_zero3_parameter_attributes(worlds):
    from zerotrain.zero import ZeroParamStatus

    for rank, res in enumerate(worlds.run(2, _log_and_status_job)):
        expected = (["[Rank 1] only on one"] if rank == 1 else []) + [f"[Rank {rank}] everywhere"]
        assert res["messages"] == expected, res["messages"]
        assert res["not_available"] is ZeroParamStatus.NOT_AVAILABLE   # one enum
        assert res["outside"] == ZeroParamStatus.NOT_AVAILABLE
        assert res["inside"] == ZeroParamStatus.AVAILABLE
        assert res["after"] == ZeroParamStatus.NOT_AVAILABLE
        assert res["after_training"] == {ZeroParamStatus.NOT_AVAILABLE}
        assert len(set(res["ids"])) == len(res["ids"]) and all(isinstance(i, int)
                                                                for i in res["ids"])
        assert res["full_shape"] == (29, 13) and res["numel"] == 29 * 13
        assert res["chunk"] == -(-29 * 13 // 2)   # this rank's padded chunk
