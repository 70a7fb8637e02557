"""An engine built without an optimizer, as DeepSpeed allows (a reference or evaluation model:
``deepspeed.initialize(model=ref_model, config=eval_config)``), on 2 gloo ranks: forward
matches the plain module, a trained checkpoint loads into it, and backward/step are refused
by name."""
from __future__ import annotations

import os

import pytest
import torch

import reference as R


def _eval_only_job(rank: int, world: int, root: str) -> dict:
    import zerotrain
    from zerotrain.errors import StateError

    out: dict = {}
    for stage in (0, 2, 3):
        save_dir = os.path.join(root, f"stage{stage}")
        trained = R.make_model(seed=0)
        engine, *_ = zerotrain.initialize(model=trained, config=R.engine_config(stage=stage))
        R.train_engine(engine, steps=2, rank=rank, ga=1)
        engine.save_checkpoint(save_dir)
        engine.eval()
        batch = R.micro_batch(5, rank, 0)
        with torch.no_grad():
            trained_loss = engine(*batch).item()

        config = R.engine_config(stage=stage)
        del config["optimizer"]
        model = R.make_model(seed=1)
        plain_loss = R.make_model(seed=1)(*batch).item()
        ref, optimizer, _, scheduler = zerotrain.initialize(model=model, config=config)
        ref.eval()
        with torch.no_grad():
            fresh_loss = ref(*batch).item()
        # DeepSpeed-Chat's plain load (an engine without optimizer takes the weights only)
        ref.load_checkpoint(save_dir, load_module_only=stage == 2)
        with torch.no_grad():
            loaded_loss = ref(*batch).item()
        refused = []
        for call in (lambda: ref.backward(ref(*batch)), ref.step):
            try:
                call()
            except StateError as e:
                refused.append(str(e))
        out[stage] = {"optimizer": optimizer, "scheduler": scheduler,
                      "inference_only": ref.inference_only, "plain": plain_loss,
                      "fresh": fresh_loss, "trained": trained_loss, "loaded": loaded_loss,
                      "refused": refused}
    return out


def test_engine_without_optimizer_runs_forward_and_loads_checkpoints(worlds, tmp_path):
    for res in worlds.run(2, _eval_only_job, str(tmp_path)):
        for stage, r in res.items():
            assert r["optimizer"] is None and r["scheduler"] is None, stage
            assert r["inference_only"], stage
            assert r["fresh"] == pytest.approx(r["plain"], abs=1e-6), stage
            assert r["loaded"] == pytest.approx(r["trained"], abs=1e-6), stage
            assert r["loaded"] != pytest.approx(r["fresh"], abs=1e-4), stage
            assert len(r["refused"]) == 2, stage
            assert all("built without one" in m for m in r["refused"]), stage


def _scheduler_without_optimizer_job(rank: int, world: int) -> str:
    import zerotrain
    from zerotrain.errors import ConfigError

    config = R.engine_config(stage=1)
    del config["optimizer"]
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    try:
        zerotrain.initialize(model=R.make_model(), config=config)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_scheduler_without_optimizer_is_a_config_error(worlds):
    for message in worlds.run(2, _scheduler_without_optimizer_job):
        assert message.startswith("optimizer") and "a scheduler needs one" in message
