"""Gradient buckets: each stage-2 bucket is freed once reduced, with or without
``overlap_comm``; reductions run in ``communication_data_type`` (default: the gradients'
dtype, so bf16 moves half the bytes of fp32); stage 3 overlaps by default and prefetches
whatever ``overlap_comm`` says."""
import reference as R
from zerotrain.stages.buckets import MAX_IN_FLIGHT

STEPS = 2


def _run(rank, world, stage, overlap, precision, comm_dtype=None, ga=1):
    import zerotrain
    config = R.engine_config(stage=stage, ga=ga, bucket=16, overlap=overlap,
                             precision=precision)
    if comm_dtype:
        config["communication_data_type"] = comm_dtype
    if overlap is None:   # the stage's default
        del config["zero_optimization"]["overlap_comm"]
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    buckets = engine.stage.buckets
    live = []
    add = buckets.add

    def spy(g, index, grad):
        add(g, index, grad)
        live.append(len(getattr(buckets, "_staging", {})))
    buckets.add = spy
    engine.comm.ledger.reset()
    R.train_engine(engine, steps=STEPS, rank=rank, ga=ga)
    blocks = sum(len(r.layout.blocks) for r in engine.stage.shard_records())
    padded = sum(r.layout.padded_numel for r in engine.stage.shard_records())
    out = {"max_live": max(live), "blocks": blocks, "padded": padded,
           "bytes": engine.comm.ledger.snapshot()["bytes"],
           "dtype": str(buckets.comm_dtype)}
    if stage == 3:
        out["prefetch"] = engine.stage.scheduler.policy.prefetch_numel
        out["overlap"] = buckets.overlap
    engine.close()
    return out


def _grid(rank, world):
    return {"no overlap": _run(rank, world, 2, False, "fp32"),
            "overlap": _run(rank, world, 2, True, "fp32"),
            "bf16": _run(rank, world, 2, False, "bf16"),
            "bf16 fp32 wire": _run(rank, world, 2, False, "bf16", "fp32"),
            "fp32 bf16 wire": _run(rank, world, 1, False, "fp32", "bf16", ga=2),
            "stage 3": _run(rank, world, 3, None, "bf16")}


def test_buckets_release_wire_dtype_and_stage3_defaults(worlds):
    for res in worlds.run(2, _grid):
        # blocks still filling (a parameter's gradient can straddle two), plus those in flight
        # without overlap_comm one reduction travels while the next blocks fill
        assert res["no overlap"]["max_live"] <= 2 + 1 < res["no overlap"]["blocks"], res
        assert res["overlap"]["max_live"] <= 2 + MAX_IN_FLIGHT < res["overlap"]["blocks"], res
        fp32, bf16 = res["bf16 fp32 wire"], res["bf16"]
        assert bf16["dtype"] == "torch.bfloat16" and fp32["dtype"] == "torch.float32"
        assert bf16["bytes"]["reduce_scatter"] * 2 == fp32["bytes"]["reduce_scatter"]
        assert fp32["bytes"]["reduce_scatter"] == 4 * fp32["padded"] * STEPS
        assert res["fp32 bf16 wire"]["bytes"]["reduce_scatter"] == (
            2 * res["fp32 bf16 wire"]["padded"] * STEPS)
        assert res["stage 3"]["overlap"] is True and res["stage 3"]["prefetch"] > 0


def _prefetch_without_overlap(rank, world):
    import zerotrain
    config = R.engine_config(stage=3, overlap=False)
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    got = (engine.stage.scheduler.policy.prefetch_numel, engine.stage.buckets.overlap)
    engine.close()
    return got


def test_stage3_prefetch_does_not_depend_on_overlap_comm(worlds):
    for prefetch, overlap in worlds.run(2, _prefetch_without_overlap):
        assert prefetch == 100 and overlap is False


def _launches(rank, world, stage, overlap):
    """Each gradient reduction's launch: asynchronous or not, and whether autograd's
    backward was still running (a post-accumulate-grad hook launched it)."""
    import torch
    import zerotrain
    config = R.engine_config(stage=stage, ga=2, bucket=16, overlap=overlap)
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    comm, launches = engine.comm, []
    for op in ("all_reduce", "reduce_scatter"):
        def spy(*args, _call=getattr(comm, op), **kwargs):
            in_backward = torch._C._current_graph_task_id() != -1
            if "vote" not in kwargs.get("label", ""):   # the backward votes aside
                launches.append((bool(kwargs.get("async_op")), in_backward))
            return _call(*args, **kwargs)
        setattr(comm, op, spy)
    engine.stage.buckets.reduce_scatter = comm.reduce_scatter
    R.train_engine(engine, steps=STEPS, rank=rank, ga=2)
    blocks = sum(len(r.layout.blocks) for r in engine.stage.shard_records())
    grads = [launch for launch in launches if launch != (False, False)]   # norms etc. aside
    engine.close()
    return {"blocks": blocks, "launches": launches, "grads": grads}


def _overlap_grid(rank, world):
    return {str((stage, overlap)): _launches(rank, world, stage, overlap)
            for stage, overlap in ((0, True), (1, True), (2, False), (2, True), (1, False))}


def test_reductions_travel_during_backward(worlds):
    """Stage 2 reduce-scatters asynchronously from the hooks whatever overlap_comm says;
    stages 0-1 do so at the boundary with overlap_comm (where DeepSpeed overlaps); stage 1
    without it leaves them to the step (DeepSpeed's default), synchronously."""
    for res in worlds.run(2, _overlap_grid):
        for case in ("(0, True)", "(1, True)"):   # one boundary per step, every block
            got = res[case]
            assert got["grads"] == [(True, True)] * got["blocks"] * STEPS, (case, got)
        for case in ("(2, False)", "(2, True)"):  # every micro-step, every block
            got = res[case]
            assert got["grads"] == [(True, True)] * got["blocks"] * STEPS * 2, (case, got)
        deferred = res["(1, False)"]
        assert deferred["grads"] == [] and len(deferred["launches"]) >= deferred["blocks"]
