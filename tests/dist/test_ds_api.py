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


def _more_comm_job(rank: int, world: int, via_alias: bool) -> dict:
    """Every further ``deepspeed.comm`` function a script calls, on 2 ranks; ``via_alias``
    imports it as ``deepspeed.comm`` through the switch."""
    from datetime import timedelta

    if via_alias:
        from zerotrain import as_deepspeed
        as_deepspeed.install()
        import deepspeed.comm as dist
    else:
        import zerotrain.comm as dist
    out: dict = {"available": dist.is_available(),
                 "ranks": dist.get_all_ranks_from_group(),
                 "ranks_of_group": dist.get_all_ranks_from_group(dist.new_group([1])),
                 "coalesce_flags": (dist.has_all_reduce_coalesced(),
                                    dist.has_coalescing_manager())}
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    out["objects"] = objects
    sent = [f"from {rank}", rank * 10]
    dist.broadcast_object_list(sent, src=1)
    out["broadcast_objects"] = sent
    bucket = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank + 1)), gather_list=bucket, dst=0)
    out["gathered"] = None if bucket is None else [t.tolist() for t in bucket]
    piece = torch.zeros(3)
    parts = [torch.full((3,), 10.0 * r) for r in range(world)] if rank == 1 else None
    dist.scatter(piece, scatter_list=parts, src=1)
    out["scattered"] = piece.tolist()
    mine = torch.zeros(2)
    dist.reduce_scatter(mine, [torch.full((2,), float(rank + r)) for r in range(world)])
    out["reduce_scattered"] = mine.tolist()
    flat_out = torch.zeros(2)
    dist.reduce_scatter_fn(flat_out, torch.arange(4.0) * (rank + 1))
    out["reduce_scatter_fn"] = flat_out.tolist()
    whole = torch.zeros(4)
    dist.allgather_fn(whole, torch.full((2,), float(rank)))
    out["allgather_fn"] = whole.tolist()
    received = [torch.zeros(1) for _ in range(world)]
    dist.all_to_all(received, [torch.tensor([10.0 * rank + r]) for r in range(world)])
    out["all_to_all"] = [t.item() for t in received]
    pair = [torch.tensor([1.0 + rank]), torch.tensor([2.0 * rank])]
    dist.all_reduce_coalesced(pair)
    out["all_reduce_coalesced"] = [t.item() for t in pair]
    outs = [torch.zeros(2), torch.zeros(4)]
    handle = dist.all_gather_coalesced(outs, [torch.full((1,), float(rank)),
                                              torch.full((2,), rank + 5.0)], async_op=True)
    handle.wait()
    out["all_gather_coalesced"] = [t.tolist() for t in outs]
    point = torch.full((2,), float(rank))
    if rank == 0:
        dist.send(point + 7, dst=1)
        work = dist.irecv(point, src=1)
        work.wait()
    else:
        dist.recv(point, src=0)
        dist.isend(point * 2, dst=0).wait()
    out["p2p"] = point.tolist()
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    if via_alias:
        out["same"] = dist.send is __import__("zerotrain.comm").comm.send
        as_deepspeed.uninstall()
    return out


def test_more_deepspeed_comm_functions_on_two_ranks(worlds):
    for via_alias in (False, True):
        for rank, res in enumerate(worlds.run(2, _more_comm_job, via_alias)):
            where = f"rank {rank} alias={via_alias}"
            assert res["available"] and res["ranks"] == [0, 1], where
            assert res["ranks_of_group"] == ([1] if rank == 1 else []), (where, res)
            assert res["objects"] == [{"rank": 0}, {"rank": 1}], where
            assert res["broadcast_objects"] == ["from 1", 10], where
            assert res["gathered"] == ([[1.0, 1.0], [2.0, 2.0]] if rank == 0 else None), where
            assert res["scattered"] == [10.0 * rank] * 3, where
            # rank r receives sum over senders s of (s + r): (0 + r) + (1 + r)
            assert res["reduce_scattered"] == [1.0 + 2 * rank] * 2, where
            expected = (torch.arange(4.0) * 3)[2 * rank:2 * rank + 2].tolist()
            assert res["reduce_scatter_fn"] == expected, where
            assert res["allgather_fn"] == [0.0, 0.0, 1.0, 1.0], where
            assert res["all_to_all"] == [0.0 + rank, 10.0 + rank], where
            assert res["all_reduce_coalesced"] == [3.0, 2.0], where
            assert res["all_gather_coalesced"] == [[0.0, 1.0], [5.0, 5.0, 6.0, 6.0]], where
            assert res["p2p"] == ([14.0, 14.0] if rank == 0 else [7.0, 7.0]), where
            assert res.get("same", True), where


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
        grads = R.summed_gradients(model, step, world)
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
        full = p.detach().clone()
    # DeepSpeed's per-parameter methods: gathered until partition(), outside any context
    bias = model.hidden.bias
    p.all_gather_coalesced([p, bias]).wait()
    coalesced = (p.ds_status, bias.ds_status, torch.equal(p.detach(), full),
                 tuple(bias.shape))
    p.partition([p, bias])
    coalesced += (p.ds_status, bias.ds_status, tuple(p.shape))
    ids = [q.ds_id for q in model.parameters()]
    res = {"messages": handler.messages, "outside": outside, "inside": inside,
           "after": p.ds_status, "ids": ids, "numel": p.ds_numel, "full_shape": full_shape,
           "chunk": p.ds_tensor.numel(), "not_available": ZeroParamStatus.NOT_AVAILABLE,
           "coalesced": coalesced}
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
        available, released = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE
        assert res["coalesced"] == (available, available, True, (29,), released, released, (0,))


def _nvme_job(rank: int, world: int, root: str) -> dict:
    import os

    import zerotrain
    from zerotrain.errors import ConfigError

    handler = _Records()
    logging.getLogger("zerotrain").addHandler(handler)
    nvme = os.path.join(root, "not", "yet", "there")
    config = R.engine_config(stage=2)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    try:
        engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
        R.train_engine(engine, steps=1, rank=rank, ga=1)
        folders = sorted(os.listdir(nvme))
        engine.close()
        blocked = os.path.join(root, "a_file")
        if rank == 0:
            open(blocked, "w").close()
        engine.comm.barrier()
        config["zero_optimization"]["offload_optimizer"]["nvme_path"] = os.path.join(
            blocked, "sub")
        try:
            zerotrain.initialize(model=R.make_model(), config=config)
            error = None
        except ConfigError as exc:
            error = str(exc)
    finally:
        logging.getLogger("zerotrain").removeHandler(handler)
    return {"folders": folders, "error": error,
            "logged": [m for m in handler.messages if "swaps to files in" in m]}


def test_nvme_path_is_created_with_a_folder_per_rank_and_logged(worlds, tmp_path):
    for rank, res in enumerate(worlds.run(2, _nvme_job, str(tmp_path))):
        assert any(f.startswith(f"zerotrain-swap-rank{rank}-") for f in res["folders"]), res
        assert len(res["logged"]) == 1 and f"rank {rank} swaps" in res["logged"][0], res
        assert "offload_optimizer.nvme_path" in res["error"], res["error"]
        assert "cannot be created" in res["error"], res["error"]


def _warnings_job(rank: int, world: int) -> dict:
    import warnings

    import zerotrain
    from zerotrain.config import ZeroTrainConfigWarning

    config = R.engine_config(stage=1, flops_profiler={"enabled": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)   # the user's line
    ours = [w for w in caught if issubclass(w.category, ZeroTrainConfigWarning)]
    engine.close()
    return {"count": len(ours), "where": [(w.filename, w.lineno) for w in ours],
            "message": [str(w.message) for w in ours]}


def test_unimplemented_keys_warn_once_on_rank_0_at_the_users_call(worlds):
    import inspect

    source, first = inspect.getsourcelines(_warnings_job)
    line = first + next(i for i, text in enumerate(source) if "the user's line" in text)
    rank0, rank1 = worlds.run(2, _warnings_job)
    assert rank1["count"] == 0 and rank0["count"] == 1, (rank0, rank1)
    assert rank0["where"] == [(__file__, line)], rank0["where"]
    assert "flops_profiler" in rank0["message"][0]


def _scheduler_job(rank: int, world: int, user_steps_too: bool) -> dict:
    import zerotrain

    handler = _Records()
    logging.getLogger("zerotrain").addHandler(handler)
    model = R.make_model()
    optimizer = R.adamw(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    config = R.engine_config(stage=2)
    del config["optimizer"]
    engine, _, _, lr_scheduler = zerotrain.initialize(model=model, optimizer=optimizer,
                                                      lr_scheduler=scheduler, config=config)
    try:
        for step in range(4):   # a loop ported from accelerate: it steps the scheduler too
            engine.backward(engine(*R.micro_batch(step, rank, 0)))
            engine.step()
            if user_steps_too:
                lr_scheduler.step()
    finally:
        logging.getLogger("zerotrain").removeHandler(handler)
    engine.close()
    return [m for m in handler.messages if "stepped outside engine.step()" in m]


def test_scheduler_stepped_by_the_loop_too_warns_once_naming_it(worlds):
    for warned in worlds.run(2, _scheduler_job, True):
        assert len(warned) == 1 and "LambdaLR" in warned[0], warned
    for warned in worlds.run(2, _scheduler_job, False):
        assert warned == []


def _wrapped_comm_job(rank: int, world: int) -> dict:
    """A counting wrapper assigned to ``deepspeed.comm``'s collectives (as DeepSpeed's tests
    and profilers set them) sees zerotrain's own: a stage-2 step's (Note "public launch
    points" in comm/communicator.py); assigning the original back restores it."""
    import zerotrain
    from zerotrain import as_deepspeed

    as_deepspeed.install()
    try:
        import deepspeed.comm as dist
        names = ("all_reduce", "reduce_scatter_fn", "allgather_fn")
        originals = {name: getattr(dist, name) for name in names}
        seen = dict.fromkeys(names, 0)

        def counting(name):
            def wrapper(*args, **kwargs):
                seen[name] += 1
                return originals[name](*args, **kwargs)
            return wrapper
        for name in names:
            setattr(dist, name, counting(name))
        dist.not_a_function = 3   # set on the alias alone
        try:
            model = R.make_model()
            engine, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=2))
            engine.comm.ledger.reset()
            R.train_engine(engine, steps=1, rank=rank, ga=1)
            calls = dict(engine.comm.ledger.snapshot()["calls"])
            engine.close()
        finally:
            for name in names:
                setattr(dist, name, originals[name])
        restored = all(getattr(zerotrain.comm, n) is originals[n] for n in names)
        leaked = hasattr(zerotrain.comm, "not_a_function")
    finally:
        as_deepspeed.uninstall()
    return {"seen": seen, "calls": calls, "restored": restored, "leaked": leaked}


def test_wrappers_set_on_deepspeed_comm_see_zerotrains_collectives(worlds):
    for res in worlds.run(2, _wrapped_comm_job):
        seen, calls = res["seen"], res["calls"]
        assert seen["reduce_scatter_fn"] == calls["reduce_scatter"] > 0, res
        assert seen["allgather_fn"] == calls["all_gather"] > 0, res
        assert seen["all_reduce"] == calls["all_reduce"] > 0, res
        assert res["restored"] and not res["leaked"], res
