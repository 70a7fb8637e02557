"""What offload moves between the host and the device, read from the copy ledger
(Note "the copy ledger" in offload/transfers.py), what the host's memory sees, read from the
host-traffic ledger (Note "host traffic" in offload/traffic.py), and that finishing
gradients and casting parameters on the device changes nothing.

On these CPU ranks the host and the device are the same memory, so the ledger counts the
copies the code issues where offloaded state crosses over: the figures a GPU run moves.
"""
import pytest
import torch

import reference as R

STEPS = 2


def _train(rank, world, stage, offload, ga, clip, precision="bf16"):
    import zerotrain
    config = R.engine_config(stage=stage, ga=ga, clip=clip, precision=precision,
                             overlap=True)
    config["optimizer"]["params"]["fused"] = True   # the host's kernel on both sides
    zero = config["zero_optimization"]
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "cpu+param":
        zero["offload_param"] = {"device": "cpu"}
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    engine.copy_ledger.reset()
    engine.host_traffic.reset()
    engine.comm.ledger.reset()
    R.train_engine(engine, steps=STEPS, rank=rank, ga=ga)
    shard = sum(r.master.numel() for r in engine.stage.shard_records())
    out = {"copies": engine.copy_ledger.snapshot()["bytes"], "shard": shard,
           "host": engine.host_traffic.snapshot(),
           "gathered": engine.comm.ledger.nbytes["all_gather"] // world}
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        out["weights"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.close()
    return out


def _grid(rank, world):
    out = {}
    for stage, offload, ga, clip in ((2, "cpu", 1, 0.0), (2, "cpu", 2, 0.5), (1, "cpu", 1, 0.5),
                                     (3, "cpu", 1, 0.0), (3, "cpu+param", 1, 0.5)):
        out[(stage, offload, ga, clip)] = (_train(rank, world, stage, offload, ga, clip),
                                           _train(rank, world, stage, None, ga, clip))
    return out


def test_the_host_does_only_adam_and_trains_bit_for_bit_like_no_offload(worlds):
    """Per parameter and step: the finished fp32 gradient lands (4 bytes; twice when
    clipping applies, since it was finished during backward for the unclipped step),
    Adam's own pass, and the fp32 master read once by the upload (or, with the
    parameters on the host, one 16-bit write of the host shard). Nothing else."""
    per_rank = worlds.run(2, _grid)
    for case in per_rank[0]:
        stage, offload, ga, clip = case
        for rank in per_rank:
            got = rank[case][0]
            psi = got["shard"]   # this rank's shard, elements
            lands = 2 if clip else 1   # the clipping of this model's gradients applies
            want = {"gradient_land": {"read": 0, "written": 4 * psi * STEPS * lands},
                    "adam": {"read": 16 * psi * STEPS, "written": 12 * psi * STEPS}}
            if offload == "cpu+param":   # the shards live on the host: up before a gather
                want["param_fill"] = {"read": 4 * psi * STEPS, "written": 2 * psi * STEPS}
                assert got["copies"]["to_device"] == got["gathered"] > 0, (case, got)
            else:
                want["upload"] = {"read": 4 * psi * STEPS, "written": 0}
                assert got["copies"]["to_device"] == 4 * psi * STEPS, (case, got)
            assert got["host"] == want, (case, got["host"])
            assert got["copies"]["to_host"] == 4 * psi * STEPS * lands, (case, got)
        for rank in per_rank:
            got, plain = rank[case]
            assert plain["copies"] == {}, "nothing crosses without offload"
            for name, value in got["weights"].items():
                assert torch.equal(value, plain["weights"][name]), (case, name)


def _one_step(rank, world, stage):
    import zerotrain
    config = R.engine_config(stage=stage, precision="bf16", overlap=True)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    loss = engine(*R.micro_batch(0, rank, 0))
    engine.backward(loss)
    after_backward = dict(engine.copy_ledger.nbytes)
    engine.step()
    after_step = dict(engine.copy_ledger.nbytes)
    shard = sum(r.master.numel() for r in engine.stage.shard_records())
    engine.close()
    return after_backward, after_step, shard


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_stream_down_during_backward(worlds, stage):
    """In the boundary micro-step each record's gradient copy starts as its buckets
    complete, before backward returns; the step waits for copies, it does not issue them."""
    for after_backward, after_step, shard in worlds.run(2, _one_step, stage):
        assert after_backward.get("to_host") == 4 * shard
        assert after_step["to_host"] == 4 * shard


def _partial(rank, world, stage, ratio):
    import zerotrain
    config = R.engine_config(stage=stage, precision="bf16", overlap=True, bucket=16, clip=0.5)
    config["optimizer"]["params"]["fused"] = True
    zero = config["zero_optimization"]
    if ratio is not None:
        zero["offload_optimizer"] = {"device": "cpu", "ratio": ratio}
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    R.train_engine(engine, steps=STEPS, rank=rank, ga=1)
    records = [r.master.numel() for r in engine.stage.shard_records()]
    held = engine.stage.tensors_by_category()
    out = {"host": engine.host_traffic.snapshot(), "records": records,
           "masters": {where: sum(t.numel() for t in held.get(where, []) if t.dim() == 1)
                       for where in ("optimizer_state", "host_optimizer_state")},
           "weights": {n: p.detach().float().clone() for n, p in model.named_parameters()}}
    engine.close()
    return out


def _partial_grid(rank, world):
    return {(stage, ratio): _partial(rank, world, stage, ratio)
            for stage in (1, 2) for ratio in (None, 0.5)}


def test_partial_offload_keeps_the_first_records_on_the_device_exactly(worlds):
    """offload_optimizer.ratio 0.5: the first half of the records are stepped on the device
    (the host never sees them), the rest on the host, and the weights are bit for bit those
    of the run without offload."""
    for results in worlds.run(2, _partial_grid):
        for stage in (1, 2):
            got, plain = results[(stage, 0.5)], results[(stage, None)]
            records = got["records"]
            kept = int(0.5 * len(records))
            offloaded = sum(records[kept:])
            assert kept >= 1 and offloaded > 0, records
            assert got["host"]["adam"] == {"read": 16 * offloaded * STEPS,
                                           "written": 12 * offloaded * STEPS}, got["host"]
            assert got["host"]["upload"] == {"read": 4 * offloaded * STEPS, "written": 0}
            # masters and moments (3 per element) counted where they live
            assert got["masters"] == {"optimizer_state": 3 * sum(records[:kept]),
                                      "host_optimizer_state": 3 * offloaded}, got["masters"]
            for name, value in plain["weights"].items():
                assert torch.equal(got["weights"][name], value), (stage, name)
