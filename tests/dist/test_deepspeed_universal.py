"""DeepSpeed Universal Checkpoint folders (``ds_to_universal`` output) resumed in zerotrain.

The fixture (tests/fixtures/make_universal_ckpt.py) is DeepSpeed's own conversion of the
ZeRO-2 fixture ``z2_fp32_w2`` (3 steps at 2 ranks). zerotrain loads it at another world
size and stage, trains the fixture's 3 further steps on its samples and must reach the
masters DeepSpeed reached (``expected.safetensors``), within 1e-6 as the ZeRO import does.
"""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures"))
import make_deepspeed_ckpts as M  # noqa: E402
import make_universal_ckpt as U  # noqa: E402

CASE = "z2_fp32_w2"
ROOT = os.path.join(U.DEFAULT_OUT, CASE)


def _resume(rank, world, stage, micro, tag):
    import zerotrain
    with open(os.path.join(M.DEFAULT_OUT, CASE, "case.json"), encoding="utf-8") as f:
        case = json.load(f)
    config = dict(case["config"], train_micro_batch_size_per_gpu=micro,
                  gradient_accumulation_steps=1, zero_optimization={"stage": stage})
    model = M.make_model(seed=1)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=M.param_groups(model),
                                      config=config)
    path, client = engine.load_checkpoint(ROOT, tag=tag)
    steps, lr = engine.global_steps, engine.get_lr()[0]
    for step in range(case["before"], case["before"] + case["after"]):
        x, y = M.micro_batch(step, rank, 0, world=world, gas=1, size=micro)
        engine.backward(engine(x, y))
        engine.step()
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return {"path": os.path.basename(path), "steps": steps, "lr": lr, "client": client,
            "masters": masters}


@pytest.mark.parametrize("tag", [None])   # found through latest_universal
def test_a_universal_checkpoint_continues_in_zerotrain(worlds, tag):
    expected = load_file(os.path.join(M.DEFAULT_OUT, CASE, "expected.safetensors"))
    for res in worlds.run(3, _resume, 3, 2, tag):
        assert res["path"] == U.TAG and res["steps"] == 3, res["path"]
        assert res["client"]["epoch"] == 2
        diff = max((res["masters"][k] - expected[k]).abs().max().item()
                   for k in res["masters"])
        assert diff <= 1e-6, diff


def test_a_planted_payload_in_a_universal_file_never_runs(tmp_path):
    import shutil
    from zerotrain.checkpoint import CheckpointError
    from zerotrain.checkpoint.deepspeed.universal import UniversalCheckpoint
    root = str(tmp_path / U.TAG)
    shutil.copytree(os.path.join(ROOT, U.TAG), root)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    torch.save({"param": Payload()}, os.path.join(root, "zero", "fc1.weight", "exp_avg.pt"))
    ckpt = UniversalCheckpoint(root)
    with pytest.raises(CheckpointError, match="refusing to read .*exp_avg.pt.*system"):
        ckpt.read_into("fc1.weight", "exp_avg", 0, 5, torch.empty(5))
    assert not marker.exists()
