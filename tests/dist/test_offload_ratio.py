"""``offload_optimizer.ratio`` at stage 3 (Note "partial offload" in offload/updater.py):
the first records keep their fp32 state on the device and are stepped there, the rest on
the host. The result is, bit for bit, the run with everything offloaded and the run without
offload; the host-traffic and copy ledgers show that only the offloaded records' bytes
cross or touch host memory; a checkpoint saved with one ratio loads with another.

On these CPU ranks the host and the device are the same memory, so the ledgers count the
copies and host passes the code issues: the figures a GPU run makes.
"""
import pytest
import torch

import reference as R

STEPS = 3
OVERFLOW = 1   # fp16 cases: the step at which every rank's loss is inf (the step is skipped)


def _config(precision, ga, clip, ratio, speculative=False):
    config = R.engine_config(stage=3, ga=ga, clip=clip, precision=precision, overlap=True,
                             nonfinite="skip")
    config["optimizer"]["params"]["fused"] = True   # the host's kernel on both sides
    if ratio is not None:
        config["zero_optimization"]["offload_optimizer"] = {
            "device": "cpu", "ratio": ratio, "speculative": speculative}
    return config


def _train(rank, precision, ga, clip, ratio, speculative=False):
    import zerotrain
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model,
                                      config=_config(precision, ga, clip, ratio, speculative))
    for step in range(STEPS):
        for micro in range(ga):
            loss = engine(*R.micro_batch(step, rank, micro))
            if precision == "fp16" and step == OVERFLOW and micro == ga - 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
    records = engine.stage.shard_records()
    on_device = sorted(getattr(engine.stage.updater, "_on_device", ()))
    held = engine.stage.tensors_by_category()
    out = {"host": engine.host_traffic.snapshot(), "copies": engine.copy_ledger.snapshot(),
           "numel": [r.master.numel() for r in records], "on_device": on_device,
           "skipped": engine.skipped_steps,
           "state": [(r.master.clone(), {k: v.clone() for k, v in r.optimizer_state.items()
                                         if isinstance(v, torch.Tensor)}) for r in records],
           "device_state": sum(t.numel() for t in held.get("optimizer_state", [])),
           "host_state": sum(t.numel() for t in held.get("host_optimizer_state", []))}
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        out["weights"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.close()
    return out


CASES = [("fp32", 1, 0.5, False), ("bf16", 2, 0.5, False), ("fp16", 1, 0.0, False),
         ("bf16", 1, 0.5, True)]
RATIOS = (0.5, 1.0, None)


def _grid(rank, world, cases):
    out = {(case, ratio): _train(rank, *case[:3], ratio, case[3])
           for case in cases for ratio in RATIOS}
    out["all on device"] = _train(rank, "bf16", 1, 0.5, 0.0)
    return out


def _scaled(snapshot, factor):
    return {phase: {k: v * factor for k, v in rw.items()} for phase, rw in snapshot.items()}


@pytest.mark.parametrize("world,cases", [(2, CASES), (3, CASES[1:])])   # 3: uneven shards
def test_ratio_at_stage_3_is_bitwise_and_only_the_offloaded_fraction_crosses(worlds, world,
                                                                             cases):
    for rank, results in enumerate(worlds.run(world, _grid, cases)):
        for case in cases:
            part, whole, plain = (results[(case, ratio)] for ratio in RATIOS)
            where = f"rank {rank} of {world}, case {case}"
            numel = part["numel"]
            kept = int((1 - 0.5) * len(numel))   # DeepSpeed's split; one record per unit here
            assert part["on_device"] == list(range(kept)) and 0 < kept < len(numel), where
            assert whole["on_device"] == [], where
            offloaded, total = sum(numel[kept:]), sum(numel)
            # every phase of host traffic and every PCIe byte scales with the offloaded
            # records' elements: the kept records never reach the host
            assert part["host"] and _scaled(part["host"], total) == _scaled(
                whole["host"], offloaded), (where, part["host"], whole["host"])
            applied = STEPS - part["skipped"]
            speculative = case[3]   # steps again what clipping invalidated: more Adam
            assert speculative or part["host"]["adam"] == {"read": 16 * offloaded * applied,
                                            "written": 12 * offloaded * applied}, where
            assert part["host"]["upload"] == {"read": 4 * offloaded * applied,
                                              "written": 0}, where
            for direction, nbytes in whole["copies"]["bytes"].items():
                assert part["copies"]["bytes"][direction] * total == nbytes * offloaded, where
            assert plain["copies"]["bytes"] == {}, where
            # memory accounting: the kept records' masters and state are device state
            assert part["device_state"] > 0 and part["host_state"] > 0, where
            assert part["device_state"] + part["host_state"] == whole["host_state"], where
            assert part["skipped"] == whole["skipped"] == plain["skipped"] == (
                1 if case[0] == "fp16" else 0), where
            for other in (whole, plain):
                for name, value in other["weights"].items():
                    assert torch.equal(part["weights"][name], value), (where, name)
                for (m1, s1), (m2, s2) in zip(part["state"], other["state"]):
                    assert torch.equal(m1, m2), where
                    assert s1.keys() == s2.keys() and all(
                        torch.equal(s1[k], s2[k]) for k in s1), where
        everything = results["all on device"]
        assert everything["on_device"] == list(range(len(everything["numel"])))
        assert "adam" not in everything["host"] and everything["copies"]["bytes"] == {}
        plain = results[(("bf16", 1, 0.5, True), None)]   # (no offload: not speculative)
        for name, value in plain["weights"].items():
            assert torch.equal(everything["weights"][name], value), name


def _resume(rank, world, save_dir, saved_with, loaded_with):
    """Train STEPS steps with ``saved_with``, saving after the first; load that into an
    engine with ``loaded_with`` and take the remaining steps there."""
    import zerotrain

    def engine_for(ratio):
        engine, *_ = zerotrain.initialize(model=R.make_model(),
                                          config=_config("bf16", 1, 0.5, ratio))
        return engine

    def weights(engine):
        with zerotrain.zero.GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}

    whole = engine_for(saved_with)
    for step in range(STEPS):
        whole.backward(whole(*R.micro_batch(step, rank, 0)))
        whole.step()
        if step == 0:
            whole.save_checkpoint(save_dir, tag=f"from-{saved_with}")
    expected = weights(whole)
    whole.close()
    out = {}
    for ratio in loaded_with:
        again = engine_for(ratio)
        again.load_checkpoint(save_dir, tag=f"from-{saved_with}")
        for step in range(1, STEPS):
            again.backward(again(*R.micro_batch(step, rank, 0)))
            again.step()
        got = weights(again)
        out[ratio] = all(torch.equal(got[n], v) for n, v in expected.items())
        again.close()
    return out


def _resumes(rank, world, save_dir):
    return {0.5: _resume(rank, world, save_dir, 0.5, (1.0, None, 0.0)),
            1.0: _resume(rank, world, save_dir, 1.0, (0.5,))}


def test_a_checkpoint_saved_with_one_ratio_loads_with_another(worlds, tmp_path):
    for results in worlds.run(2, _resumes, str(tmp_path)):
        assert results == {0.5: {1.0: True, None: True, 0.0: True}, 1.0: {0.5: True}}
