"""The speculative host step (Note "speculation then validation" in offload/speculation.py)
gives, bit for bit, the weights and optimizer state of the step without speculation: with
clipping active or not, an fp16 overflow and its skipped step, a changed loss scale,
gradient accumulation, a learning rate changed between backward and step, something that
settles between backward and step, at stages 1-3, with the state in RAM or on NVMe."""
import torch

import reference as R

STEPS = 4
OVERFLOW, SETTLE, NEW_LR = 1, 2, 3   # the step at which each disturbance happens


def _train(rank, stage, device, precision, ga, clip, speculative, nvme_dir):
    import zerotrain
    config = R.engine_config(stage=stage, ga=ga, clip=clip, precision=precision, overlap=True,
                             nonfinite="skip")
    config["optimizer"]["params"]["fused"] = True
    offload = {"device": device, "speculative": speculative}
    if device == "nvme":
        offload["nvme_path"] = nvme_dir
    config["zero_optimization"]["offload_optimizer"] = offload
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    at_settle = None
    for step in range(STEPS):
        for micro in range(ga):
            loss = engine(*R.micro_batch(step, rank, micro))
            last = micro == ga - 1
            if step == OVERFLOW and last:
                loss = loss * float("inf")   # every rank: the step is skipped
            engine.backward(loss)
            if step == SETTLE and last:
                engine.settle()              # as a checkpoint save would, before step()
                at_settle = _state(engine)   # what a save would read: no step taken yet
            if step == NEW_LR and last:
                for group in engine.optimizer.param_groups:
                    group["lr"] *= 0.5
            engine.step()
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    state = _state(engine)
    traffic = engine.host_traffic.snapshot()
    skipped = engine.skipped_steps
    engine.close()
    return {"weights": weights, "state": state, "traffic": traffic, "skipped": skipped,
            "at_settle": at_settle}


def _state(engine):
    return [(r.master.clone(), {k: v.clone() for k, v in r.optimizer_state.items()
                                if isinstance(v, torch.Tensor)})
            for r in engine.stage.shard_records()]


CASES = [(1, "cpu", "fp32", 1, 0.0), (2, "cpu", "bf16", 2, 0.5), (2, "nvme", "fp16", 1, 0.0),
         (3, "cpu", "fp16", 2, 0.5), (3, "nvme", "bf16", 1, 0.5)]


def _grid(rank, world, nvme_dir):
    return {case: (_train(rank, *case, True, nvme_dir), _train(rank, *case, False, nvme_dir))
            for case in CASES}


def test_speculative_host_step_is_bitwise_the_step_without_speculation(worlds, tmp_path):
    for rank, results in enumerate(worlds.run(2, _grid, str(tmp_path))):
        for case, (spec, plain) in results.items():
            where = f"rank {rank} case {case}"
            assert spec["skipped"] == plain["skipped"] >= 1, where
            for name, value in plain["weights"].items():
                assert torch.equal(spec["weights"][name], value), (where, name)
            for key in ("state", "at_settle"):
                for (m1, s1), (m2, s2) in zip(spec[key], plain[key]):
                    assert torch.equal(m1, m2), (where, key)
                    assert s1.keys() == s2.keys(), (where, key)
                    assert all(torch.equal(s1[k], s2[k]) for k in s1), (where, key)
            # speculation ran, and was undone where it did not hold (overflow, settle,
            # new lr; clipping), which the plain run never does
            assert spec["traffic"]["keep"]["read"] > 0, (where, spec["traffic"])
            assert spec["traffic"]["restore"]["written"] > 0, (where, spec["traffic"])
            assert "keep" not in plain["traffic"] and "restore" not in plain["traffic"], where


def _traced_both(rank, world, directory):
    return [_traced(rank, f"{directory}/host-step-{speculative}.json", speculative)
            for speculative in (False, True)]


def _traced(rank, path, speculative):
    import json
    import zerotrain
    config = R.engine_config(stage=2, precision="bf16", overlap=True, bucket=16)
    config["zero_optimization"]["offload_optimizer"] = {
        "device": "cpu", "trace_path": path, "speculative": speculative}
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    R.train_engine(engine, steps=2, rank=rank, ga=1)
    records = len(engine.stage.shard_records())
    engine.close()
    with open(path if rank == 0 else f"{path}.rank{rank}") as f:
        return json.load(f), records


def test_trace_is_a_trace_event_file_and_records_step_in_arrival_order(worlds, tmp_path):
    """The per-record timeline (offload/trace.py) is Chrome's trace-event JSON, and it shows
    each record's Adam step in the order the gradients arrived (backward's order: the last
    layers first), not in the layout order."""
    runs = [run for rank in worlds.run(2, _traced_both, str(tmp_path)) for run in rank]
    for trace, records in runs:   # without and with speculation, on both ranks
        events = trace["traceEvents"]
        assert isinstance(events, list) and events
        for event in events:
            assert {"name", "ph", "pid", "tid"} <= event.keys(), event
            assert event["ph"] in ("X", "i", "M"), event
            if event["ph"] != "M":
                assert isinstance(event["ts"], float) and event["ts"] >= 0, event
            if event["ph"] == "X":
                assert event["dur"] >= 0, event
        arrived = [e["args"]["record"] for e in events if e["name"] == "gradient ready"]
        stepped = [e["args"]["record"] for e in sorted(events, key=lambda e: e.get("ts", 0))
                   if e["name"] == "adam"]
        uploaded = [e["args"]["record"] for e in events if e["name"] == "upload"]
        assert records > 2 and sorted(arrived) == list(range(records)), (arrived, records)
        assert stepped == arrived == uploaded != list(range(records)), (stepped, arrived)
