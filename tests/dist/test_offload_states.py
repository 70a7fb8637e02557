"""``engine.offload_states`` / ``reload_states`` (Note "moving storages, not tensors" in
offload/states.py), on CPU ranks by construction: the mover is built with the crossing
forced (on a CPU run the host is the device and nothing would move) and
``torch.cuda.is_available`` reports True, so pinned host buffers are asked for (the
allocation itself is recorded and made pageable). The ledger says which kinds moved and how
many bytes; every tensor of a moved kind is on a new storage and every other one where it
was; training after a reload, also in the middle of an accumulation window, is bit for bit
the training without the round trip. tests/gpu/test_offload_states_gpu.py checks the memory
on a real device."""
import torch

import reference as R

STEPS, GA = 3, 2


def _storages(tensors):
    """Per tensor (in order): its storage's address and size. Compared tensor by tensor: on
    CPU ranks host and "device" share one allocator, so a freed storage's address may come
    back for another tensor, never for the tensor whose storage is being copied."""
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            for t in tensors if t is not None and t.untyped_storage().nbytes()]


def _all_new(old, new):
    return len(old) == len(new) and all(a[0] != b[0] and a[1] == b[1]
                                        for a, b in zip(old, new))


def _run(rank, world, stage, precision, include, ratio, round_trip):
    import zerotrain
    from zerotrain.errors import StateError
    from zerotrain.offload import states

    config = R.engine_config(stage=stage, ga=GA, clip=0.5, precision=precision, overlap=True)
    config["optimizer"]["params"]["fused"] = True
    if ratio is not None:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": ratio}
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    asked = []   # (bytes, pinned) of each host buffer the mover allocated
    real_buffer = states.host_buffer
    states.host_buffer = lambda n, pin: asked.append((n, pin)) or real_buffer(n, False)
    engine._moved = states.StateMover(engine.device, force_crossing=True)
    report = {}
    try:
        for step in range(STEPS):
            for micro in range(GA):
                if round_trip and step >= 1 and micro == 1:   # mid-window: gradients held
                    report[step] = _round_trip(engine, include, StateError)
                engine.backward(engine(*R.micro_batch(step, rank, micro)))
                engine.step()
    finally:
        states.host_buffer = real_buffer
    report["ledger"] = engine._moved.ledger.snapshot()
    report["asked"] = asked
    report["records"] = [(r.master.clone(), {k: v.clone() for k, v in r.optimizer_state.items()
                                             if isinstance(v, torch.Tensor)})
                         for r in engine.stage.shard_records()]
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        report["weights"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.close()
    return report


def _round_trip(engine, include, StateError):
    """Offload, check what moved and that training refuses, reload."""
    roots = engine.stage.movable_states()
    before = {kind: _storages(ts) for kind, ts in roots.items()}
    real_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True   # pinned buffers are asked for
    try:
        engine.offload_states(include=include)
    finally:
        torch.cuda.is_available = real_available
    after = {kind: _storages(ts) for kind, ts in roots.items()}
    refused = []   # step always; forward when the parameters are away
    calls = [lambda: engine.step()]
    if {"lp_params", "hp_params"} & engine._moved.away:
        calls.append(lambda: engine(*R.micro_batch(0, 0, 0)))
    for call in calls:
        try:
            call()
            refused.append(False)
        except StateError as exc:
            refused.append("reload_states()" in str(exc))
    engine.reload_states()
    back = {kind: _storages(ts) for kind, ts in roots.items()}
    return {"before": before, "after": after, "back": back, "refused": refused,
            "away_after_reload": sorted(engine._moved.away)}


def _grid(rank, world):
    cases = {
        "stage 1 fp32": (1, "fp32", None, None),
        "stage 2 bf16": (2, "bf16", None, None),
        "stage 3 fp32": (3, "fp32", None, None),            # shards are the masters
        "stage 3 bf16 optim only": (3, "bf16", ["optim_states"], None),
        "stage 3 bf16 ratio 0.5": (3, "bf16", None, 0.5),   # host masters stay put
    }
    return {name: (_run(rank, world, *case, True), _run(rank, world, *case, False))
            for name, case in cases.items()}


def test_offload_states_moves_the_named_states_and_training_resumes_bit_for_bit(worlds):
    for rank, results in enumerate(worlds.run(2, _grid)):
        for name, (moved, plain) in results.items():
            where = f"rank {rank}, {name}"
            for step in range(1, STEPS):
                trip = moved[step]
                assert trip["refused"] == [True] * (1 if "optim only" in name else 2), \
                    (where, trip["refused"])
                assert trip["away_after_reload"] == [], where
                for kind, storages in trip["before"].items():
                    named = "optim only" not in name or kind == "optim_states"
                    if not storages:
                        continue
                    if named:   # every storage of the kind is a new one while away...
                        assert _all_new(storages, trip["after"][kind]), (where, kind)
                        # ...and a new one again on the device after the reload
                        assert _all_new(trip["after"][kind], trip["back"][kind]), where
                    elif not ("fp32" in name and kind in ("hp_params", "lp_params")):
                        assert trip["after"][kind] == storages, (where, kind)
            ledger = moved["ledger"]
            first = moved[1]["before"]
            optim = sum(n for _, n in first["optim_states"])
            assert optim > 0, where
            # each kind's bytes, both ways, once per round trip (first trip: state exists)
            assert ledger["bytes"]["optim_states/to_host"] == ledger["bytes"][
                "optim_states/to_device"], where
            assert ledger["bytes"]["optim_states/to_host"] >= optim * (STEPS - 1), where
            if "optim only" in name:
                assert set(ledger["bytes"]) == {"optim_states/to_host",
                                                "optim_states/to_device"}, where
            else:
                assert {"hp_params/to_host", "lp_params/to_host"} <= set(ledger["bytes"]), where
                grads = "lp_grads" if name.startswith(("stage 2", "stage 3")) else \
                    "contiguous_grad_buffer"   # mid-window: the sums so far, kept
                assert ledger["bytes"][f"{grads}/to_host"] > 0, (where, ledger)
            if "ratio" in name:   # only the masters kept on the device move
                host_masters = sum(r[0].numel() * 4 for r in moved["records"])
                assert 0 < ledger["bytes"]["hp_params/to_host"] < host_masters * (STEPS - 1)
            # pinned buffers asked for, and the second trip reuses those of the first
            assert moved["asked"] and all(pin for _, pin in moved["asked"]), where
            assert ledger["reused"] > 0 and ledger["pinned"] == ledger["reused"] + len(
                moved["asked"]), (where, ledger)
            for n, value in plain["weights"].items():
                assert torch.equal(moved["weights"][n], value), (where, n)
            for (m1, s1), (m2, s2) in zip(moved["records"], plain["records"]):
                assert torch.equal(m1, m2) and s1.keys() == s2.keys(), where
                assert all(torch.equal(s1[k], s2[k]) for k in s1), where
