"""Communication per step, counted at the torch.distributed call (comm/ledger.py's ledger).

Rule: all_reduce counts twice its tensor, reduce_scatter its input, all_gather its output.
Stages 0-2 move 2Ψ elements per optimizer step (Ψ padded to a multiple of the world size
per parameter), plus one scalar all-reduce for the global gradient norm when sharded;
stage 3 moves 3Ψ per micro-step and step (gather in forward, again in backward,
reduce-scatter), with nothing kept gathered between uses.
"""
import pytest

import reference as R

STEPS = 2


def _volume(rank, world, stage, ga, overlap=False):
    import zerotrain
    model = R.make_model()
    config = R.engine_config(stage=stage, ga=ga, overlap=overlap)
    config["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                       stage3_max_reuse_distance=0,
                                       stage3_prefetch_bucket_size=100)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    engine.comm.ledger.reset()
    R.train_engine(engine, steps=STEPS, rank=rank, ga=ga)
    padded = sum(r.layout.padded_numel for r in engine.stage.shard_records())
    psi = sum(p.numel() for p in model.parameters())
    return {"ledger": engine.comm.ledger.snapshot(), "padded": padded, "psi": psi}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_two_psi_elements_per_step(worlds, world, stage):
    for res in worlds.run(world, _volume, stage, 1):
        elements, calls = res["ledger"]["elements"], res["ledger"]["calls"]
        # counted apart: each step's collective fingerprint (comm/trail.py: 16 float32)
        # and, at ga=1, two votes of 6 int64 (before the backward, which reduces, and the
        # update: Note "backwards that reduce" in engine/accumulation.py)
        checks = 2 * (6 + 6) * STEPS
        if stage == 0:
            assert elements == {"all_reduce": 2 * res["psi"] * STEPS,
                                "divergence_check": 2 * 16 * STEPS + checks}
        else:
            assert elements["reduce_scatter"] == res["padded"] * STEPS
            assert elements["all_gather"] == res["padded"] * STEPS
            assert elements["all_reduce"] == 2 * STEPS      # the gradient-norm scalar
            assert elements["divergence_check"] == 2 * 16 * STEPS + checks
            assert calls["all_reduce"] == 3 * STEPS         # the norm and the two votes
            assert res["padded"] - res["psi"] < world * 8   # TinyNet has 8 parameters


def test_stage2_reduces_every_micro_step_and_stage1_once(worlds):
    ga = 3
    stage1 = worlds.run(2, _volume, 1, ga)[0]
    stage2 = worlds.run(2, _volume, 2, ga)[0]
    assert stage1["ledger"]["elements"]["reduce_scatter"] == stage1["padded"] * STEPS
    assert stage2["ledger"]["elements"]["reduce_scatter"] == stage2["padded"] * STEPS * ga
    for res in (stage1, stage2):
        assert res["ledger"]["elements"]["all_gather"] == res["padded"] * STEPS


@pytest.mark.parametrize("world, overlap", [(2, False), (3, False), (2, True)])
def test_stage3_moves_three_psi_elements_per_step(worlds, world, overlap):
    """With overlap_comm the next units are prefetched: earlier, but never more."""
    for res in worlds.run(world, _volume, 3, 1, overlap):
        elements = res["ledger"]["elements"]
        assert elements["all_gather"] == 2 * res["padded"] * STEPS
        assert elements["reduce_scatter"] == res["padded"] * STEPS
        assert elements["all_reduce"] == 2 * STEPS
