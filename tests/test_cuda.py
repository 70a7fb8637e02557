"""On a CUDA machine: the offload paths (pinned host state, device-to-host gradient staging,
asynchronous host-to-device refresh, NVMe swapping) train like no offload, at stages 1-3.

Skipped without CUDA (CI has none). One process, world size 1, NCCL; run with
``pytest -m gpu tests/test_cuda.py``.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {here!r})
    import zerotrain, reference as R

    def run(stage, offload, precision, dpu=False):
        config = R.engine_config(stage=stage, ga=2, clip=0.5, precision=precision)
        zero = config["zero_optimization"]
        if offload in ("cpu", "nvme"):
            zero["offload_optimizer"] = {{"device": offload, "pin_memory": True,
                                          "nvme_path": {nvme!r}, "dpu": dpu}}
        if offload == "cpu+param":
            zero["offload_optimizer"] = {{"device": "cpu", "pin_memory": True}}
            zero["offload_param"] = {{"device": "cpu", "pin_memory": True}}
        torch.manual_seed(0)
        model = R.TinyNet().cuda()
        engine, *_ = zerotrain.initialize(model=model, config=config)
        for step in range(4):
            for micro in range(2):
                x, y = R.micro_batch(step, 0, micro)
                engine.backward(engine(x.cuda(), y.cuda()))
                engine.step()
        engine.eval()
        with zerotrain.zero.GatheredParameters(list(model.parameters())):
            out = {{n: p.detach().float().cpu() for n, p in model.named_parameters()}}
        engine.close()
        return out

    results = {{}}
    for precision in ("fp32", "bf16"):
        for stage in (1, 2, 3):
            base = run(stage, "none", precision)
            kinds = ["cpu", "nvme"] + (["cpu+param"] if stage == 3 else [])
            for kind in kinds:
                got = run(stage, kind, precision)
                results[f"{{precision}} stage {{stage}} {{kind}}"] = R.max_diff(got, base)
    results["dpu runs"] = float(len(run(2, "cpu", "bf16", dpu=True)))
    print("RESULT " + json.dumps(results))
""")


def test_offload_on_cuda_matches_no_offload(tmp_path):
    script = tmp_path / "cuda_offload.py"
    script.write_text(SCRIPT.format(here=HERE, nvme=str(tmp_path)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
    import json
    results = json.loads(line[len("RESULT "):])
    for case, diff in results.items():
        if case.startswith("fp32"):
            assert diff <= 1e-6, (case, diff)
        elif case.startswith("bf16"):
            assert diff <= 1e-2, (case, diff)
