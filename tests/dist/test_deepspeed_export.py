"""``zerotrain consolidate --to deepspeed``: a zerotrain checkpoint written as a DeepSpeed ZeRO
checkpoint (stage 2 and stage 3) for another world size. Always: the export read back by zerotrain's DeepSpeed
importer continues exactly as zerotrain's own checkpoint does. When DeepSpeed is importable:
the real DeepSpeed loads it with ``load_checkpoint`` and continues equal to zerotrain (fp32
within 1e-6)."""
import importlib.util
import os

import pytest
import torch

import reference as R

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
MICRO = 4


def _zt(stage, seed=0):
    import zerotrain
    engine, _, _, _ = zerotrain.initialize(model=R.make_model(seed),
                                           config=R.engine_config(stage=stage, micro_size=MICRO))
    return engine


def _train(engine, rank, first, steps):
    for step in range(first, first + steps):
        engine.backward(engine(*R.micro_batch(step, rank, 0, MICRO)))
        engine.step()


def _masters(engine):
    import zerotrain
    with zerotrain.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _save_job(rank, world, root):
    engine = _zt(2)
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(os.path.join(root, "zt"))


def _continue_zerotrain(rank, world, root):
    """Zerotrain resumes its own checkpoint and the export (read as DeepSpeed's), 2 steps."""
    own = _zt(1, seed=3)
    own.load_checkpoint(os.path.join(root, "zt"))
    saved = _masters(own)
    _train(own, rank, 2, 2)
    other = _zt(2, seed=4)
    other.load_checkpoint(os.path.join(root, "ds"))
    steps = other.global_steps
    _train(other, rank, 2, 2)
    return {"diff": R.max_diff(_masters(own), _masters(other)), "steps": steps,
            "own": _masters(own), "saved": saved}


def _continue_deepspeed(rank, world, root, stage):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    deepspeed.init_distributed(dist_backend="gloo")
    config = R.engine_config(stage=stage, micro_size=MICRO)
    config["optimizer"]["params"]["torch_adam"] = True
    for key in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"):
        config["zero_optimization"].pop(key)
    if stage == 3:   # the biases and the norm persist (kept whole), the weights partition
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 30
    model = R.make_model(5)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    path, _ = engine.load_checkpoint(os.path.join(root, "ds"))
    steps = engine.global_steps
    for step in range(2, 4):
        engine.backward(engine(*R.micro_batch(step, rank, 0, MICRO)))
        engine.step()
    return {"path": path, "steps": steps,
            "masters": {n: safe_get_full_fp32_param(p).detach().clone()
                        for n, p in engine.module.named_parameters()}}


def _expected_files(stage):
    if stage == 3:
        return sorted(f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
                      for r in range(3) for kind in ("model", "optim"))
    return ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                             for r in range(3)]


@pytest.mark.parametrize("stage", [2, 3])
def test_export_to_deepspeed_continues_as_zerotrain_at_another_world_size(worlds, tmp_path,
                                                                          stage):
    from zerotrain.checkpoint.deepspeed import load_file
    from zerotrain.checkpoint.full_weights import consolidate_main
    root = str(tmp_path)
    worlds.run(2, _save_job, root)
    assert consolidate_main([os.path.join(root, "zt"), os.path.join(root, "ds"), "--to",
                             "deepspeed", "--stage", str(stage), "--world-size", "3"]) == 0
    tag = open(os.path.join(root, "ds", "latest")).read()
    assert sorted(os.listdir(os.path.join(root, "ds", tag))) == _expected_files(stage)
    for name in os.listdir(os.path.join(root, "ds", tag)):
        if stage < 3:                       # plain data: no class named
            torch.load(os.path.join(root, "ds", tag, name), weights_only=True)
        else:                               # DeepSpeed's loss scaler, by class name only
            value = load_file(os.path.join(root, "ds", tag, name))
            if "optim" in name:
                scaler = value["optimizer_state_dict"]["loss_scaler"]
                assert scaler.qualname.endswith(".LossScaler"), scaler
    results = worlds.run(3, _continue_zerotrain, root)
    for res in results:
        assert res["diff"] == 0.0 and res["steps"] == 2, res
    if HAS_DEEPSPEED:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        from distributed import run_world
        if stage == 3:
            assert R.max_diff(dict(get_fp32_state_dict_from_zero_checkpoint(
                os.path.join(root, "ds"))), results[0]["saved"]) == 0.0
        for res in run_world(_continue_deepspeed, 3, root, stage, timeout=600):
            assert res["steps"] == 2, res
            assert R.max_diff(res["masters"], results[0]["own"]) <= 1e-6


def test_export_to_deepspeed_refuses_an_unknown_stage_and_a_missing_world_size(tmp_path, capsys,
                                                                                caplog,
                                                                                monkeypatch):
    import logging
    from zerotrain.checkpoint.full_weights import consolidate_main
    monkeypatch.setattr(logging.getLogger("zerotrain"), "propagate", True)
    with pytest.raises(SystemExit):
        consolidate_main([str(tmp_path), str(tmp_path / "o"), "--to", "deepspeed",
                          "--stage", "2"])
    assert "--world-size" in capsys.readouterr().err
    assert consolidate_main([str(tmp_path), str(tmp_path / "o"), "--to", "deepspeed",
                             "--stage", "4", "--world-size", "2"]) == 1
    assert "--stage 4" in caplog.text and "1, 2 and 3" in caplog.text
