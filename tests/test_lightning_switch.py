"""PyTorch Lightning's DeepSpeed strategy at stage 3, unmodified, through ``zerotrain launch
--as-deepspeed`` (2 gloo ranks, with the two-method CPU subclass of docs/lightning.md):
trains, saves with ``trainer.save_checkpoint``, and Lightning's own
``convert_zero_checkpoint_to_fp32_state_dict`` turns the save into the weights the same
script trains with ``strategy="ddp"``.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("pytorch_lightning",
                    reason="pytorch-lightning is not installed (pip install zerotrain[dev])")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "hf_scripts", "lightning_train.py")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"),
                                                    env.get("PYTHONPATH", "")) if p)
    return env


@pytest.mark.slow
def test_lightning_stage3_checkpoint_converts_to_the_weights_ddp_trains(tmp_path):
    # one launch trains DDP, then DeepSpeed stage 3 (DDP never imports deepspeed)
    out = tmp_path / "weights.pt"
    run = subprocess.run([sys.executable, "-m", "zerotrain", "launch", "--as-deepspeed",
                          "--standalone", "--nproc_per_node", "2", SCRIPT, "--strategies",
                          "ddp,deepspeed_stage_3", "--root", str(tmp_path), "--out", str(out)],
                         cwd=str(tmp_path), env=_env(), capture_output=True, text=True,
                         timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    # the save is zerotrain's (a manifest, no DeepSpeed .pt files); Lightning converted it
    saved = tmp_path / "deepspeed_stage_3" / "final.ckpt" / "checkpoint"
    assert (saved / "manifest.json").is_file() and not list(saved.glob("*.pt"))
    results = torch.load(out, weights_only=True)
    ddp, ours = results["ddp"], results["deepspeed_stage_3"]
    torch.manual_seed(0)   # pl.seed_everything(0): the weights before training
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        from lightning_train import Regression
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    initial = Regression().state_dict()
    assert sorted(ours) == sorted(ddp) == sorted(initial)
    for name, value in ddp.items():
        assert not torch.allclose(value, initial[name]), name     # training moved it
        assert ours[name].dtype == torch.float32
        torch.testing.assert_close(ours[name], value, rtol=1e-6, atol=1e-6, msg=name)
