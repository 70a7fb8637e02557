"""On a CUDA machine: ``engine.offload_states`` frees the device memory of the states it moves
and ``reload_states`` takes it back, training on bit for bit as without the round trip, its
pinned host buffers reused by the next round trip; and the offload path's pinned buffers
(the upload and send staging slots for pageable state, the host gradient buffers) are
allocated once and reused step after step.

Skipped without CUDA (CI has none; tests/dist/test_offload_states.py and
tests/unit/test_offload_cuda_paths.py check the same decisions on CPU). One process, world
size 1; run with ``pytest -m gpu tests/gpu``.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/


def _run(tmp_path, script: str) -> dict:
    path = tmp_path / "script.py"
    path.write_text(script)
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


STATES = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {here!r})
    import zerotrain, reference as R
    WIDTH, DEPTH = 1024, 8   # 8.4M parameters: ~100 MB of fp32 masters and Adam state

    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH)
                                                for _ in range(DEPTH)])
        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.layers(x).float(), y.float())

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(8, WIDTH, generator=g).cuda(),
                torch.randn(8, WIDTH, generator=g).cuda())

    def run(stage, round_trip):
        config = R.engine_config(stage=stage, precision="bf16")
        config["optimizer"]["params"]["fused"] = True
        torch.manual_seed(0)
        model = Wide().cuda()
        engine, *_ = zerotrain.initialize(model=model, config=config)
        out = {{"used": []}}
        for step in range(4):
            if round_trip and step >= 2:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                engine.offload_states(pin_memory=True)
                torch.cuda.synchronize()
                during = torch.cuda.memory_allocated()
                out["pinned"] = all(t.is_pinned() for t in engine._moved.tensors())
                out["away"] = sorted(engine._moved.away)
                engine.reload_states()
                torch.cuda.synchronize()
                out["used"].append([before, during, torch.cuda.memory_allocated()])
            engine.backward(engine(*batch(step)))
            engine.step()
        out["ledger"] = engine._moved.ledger.snapshot()
        out["params"] = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                            for p in model.parameters())
        with zerotrain.zero.GatheredParameters(list(model.parameters())):
            out["weights"] = [p.detach().float().cpu() for p in model.parameters()]
        engine.close()
        return out

    results = {{}}
    for stage in (2, 3):
        moved, plain = run(stage, True), run(stage, False)
        same = all(torch.equal(a, b) for a, b in zip(moved.pop("weights"),
                                                     plain.pop("weights")))
        results[stage] = dict(moved, same=same)
    print("RESULT " + json.dumps(results))
""")


def test_offload_states_frees_device_memory_and_reload_takes_it_back(tmp_path):
    for stage, got in _run(tmp_path, STATES.format(here=HERE)).items():
        assert got["same"], stage                  # bit for bit after two round trips
        assert got["pinned"] and got["away"] == ["hp_params", "lp_params", "optim_states"]
        # at least the fp32 masters and both Adam moments (12 bytes per parameter) leave
        state = 12 * got["params"]
        for before, during, after in got["used"]:
            assert before - during >= state, (stage, before, during)
            assert abs(after - before) <= state // 10, (stage, before, after)
        ledger = got["ledger"]
        assert ledger["reused"] > 0 and ledger["reused"] == ledger["pinned"] // 2, ledger
        for kind in ("optim_states", "hp_params", "lp_params"):
            assert ledger["bytes"][f"{kind}/to_host"] == ledger["bytes"][f"{kind}/to_device"]


REUSE = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {here!r})
    import zerotrain, reference as R

    def run(stage, param):
        config = R.engine_config(stage=stage, precision="bf16", overlap=True)
        zero = config["zero_optimization"]
        zero["offload_optimizer"] = {{"device": "cpu", "pin_memory": False}}
        if param:
            zero["offload_param"] = {{"device": "cpu", "pin_memory": False}}
        torch.manual_seed(0)
        model = R.TinyNet().cuda()
        engine, *_ = zerotrain.initialize(model=model, config=config)
        transfers = engine.stage.storage.transfers
        seen = []
        for step in range(4):
            x, y = R.micro_batch(step, 0, 0)
            engine.backward(engine(x.cuda(), y.cuda()))
            engine.step()
            torch.cuda.synchronize()
            slots = transfers.tensors()
            grads = engine.stage.updater.gradients.tensors()
            seen.append({{"slots": [t.data_ptr() for t in slots],
                          "slots_pinned": all(t.is_pinned() for t in slots),
                          "grads": [t.data_ptr() for t in grads],
                          "grads_pinned": all(t.is_pinned() for t in grads)}})
        traffic = engine.host_traffic.snapshot()
        engine.close()
        return {{"seen": seen, "traffic": traffic}}

    print("RESULT " + json.dumps({{"stage 2": run(2, False), "stage 3 param": run(3, True)}}))
""")


def test_offload_pinned_buffers_are_allocated_once_and_reused(tmp_path):
    for case, got in _run(tmp_path, REUSE.format(here=HERE)).items():
        seen = got["seen"]
        first = seen[0]
        # pageable masters (and, with offload_param, shards) go up through two pinned
        # staging slots each way, and the gradients land in one pinned buffer per record
        assert 1 <= len(first["slots"]) <= (4 if "param" in case else 2), (case, first)
        assert first["slots_pinned"] and first["grads_pinned"] and first["grads"], case
        for later in seen[1:]:   # one pinned gradient buffer per record, for good
            assert later["grads"] == first["grads"], (case, later)
        # a staging slot grows to the largest record it has carried, and records take the
        # two slots in turn, so by the end of the second step each slot has carried the
        # largest it will be given: from then on nothing is allocated again
        for later in seen[2:]:
            assert later["slots"] == seen[1]["slots"], (case, later)
        assert got["traffic"]["upload_staging"]["read"] > 0 or "param" in case, got["traffic"]
        if "param" in case:
            assert got["traffic"]["send_staging"]["read"] > 0, got["traffic"]
