"""On a CUDA machine: the offload paths (pinned host state, device-to-host gradient staging,
asynchronous host-to-device refresh, NVMe swapping) train like no offload, at stages 1-3;
the device follows LOCAL_RANK whatever the group's backend string; copies run on their own
streams; and the copy ledger counts 2 bytes per shard element each way at stage 2 bf16.

Skipped without CUDA (CI has none; tests/unit/test_devices.py and
tests/dist/test_offload_copies.py check the same decisions and counts on CPU). One process,
world size 1; run with ``pytest -m gpu tests/gpu``.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# tests/: where reference.py lives for the child scripts
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


DEVICE_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {here!r})
    import zerotrain, reference as R
    from zerotrain.offload import Transfers
    backend = sys.argv[1] or None
    os.environ["LOCAL_RANK"] = str(torch.cuda.device_count() - 1)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    config = R.engine_config(stage=2, precision="bf16")
    config["zero_optimization"]["offload_optimizer"] = {{"device": "cpu", "pin_memory": True}}
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    engine.copy_ledger.reset()
    R.train_engine(engine, steps=2, rank=0, ga=1)
    shard = sum(r.master.numel() for r in engine.stage.shard_records())
    out = {{"device": str(next(model.parameters()).device), "comm": str(engine.comm.device),
           "current": torch.cuda.current_device(), "copies": engine.copy_ledger.nbytes,
           "shard": shard}}
    # side-stream copies: right values, made on the transfer streams
    t = Transfers(torch.device("cuda", torch.cuda.current_device()))
    host = torch.randn(1 << 20).pin_memory()
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 2048          # keep the compute stream busy meanwhile
    up = t.upload(host, torch.bfloat16)
    down = torch.empty(1 << 20, dtype=torch.bfloat16).pin_memory()
    t.to_host(down, up).synchronize()
    sent, ctx = t.send(host, up.device)
    torch.cuda.synchronize()
    out["upload_exact"] = bool(torch.equal(down, host.to(torch.bfloat16)))
    out["send_exact"] = bool(torch.equal(sent.cpu(), host))
    out["streams"] = sorted(t._streams)
    engine.close()
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.parametrize("backend", ["", "nccl", "cpu:gloo,cuda:nccl"])
def test_device_selection_side_stream_copies_and_copy_ledger_on_cuda(tmp_path, backend):
    """No backend, NCCL and a mixed group all train on cuda:LOCAL_RANK; the copies run on
    their own streams with exact values; stage 2 bf16 offload moves 2 bytes per shard
    element each way per step."""
    import json
    script = tmp_path / "devices.py"
    script.write_text(DEVICE_SCRIPT.format(here=HERE))
    out = subprocess.run([sys.executable, str(script), backend], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(next(l for l in out.stdout.splitlines()
                          if l.startswith("RESULT "))[len("RESULT "):])
    last = torch.cuda.device_count() - 1
    assert res["device"] == res["comm"] == f"cuda:{last}" and res["current"] == last, res
    assert res["copies"] == {"to_host": 2 * 2 * res["shard"],
                             "to_device": 2 * 2 * res["shard"]}, res
    assert res["upload_exact"] and res["send_exact"], res
    assert res["streams"] == ["to_device", "to_host"], res


GATHER_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    sys.path.insert(0, {here!r})
    import zerotrain, reference as R
    sys.path.insert(0, {here!r} + "/dist")
    from test_gather_in_place import WritesInto, _inside
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)

    def run(offload):
        config = R.engine_config(stage=3, precision="bf16")
        zero = config["zero_optimization"]
        zero["stage3_max_reuse_distance"] = 0
        if offload:
            zero["offload_param"] = {{"device": "cpu", "pin_memory": True}}
            zero["offload_optimizer"] = {{"device": "cpu", "pin_memory": True}}
        model = R.make_model().cuda()
        engine, *_ = zerotrain.initialize(model=model, config=config)
        units, comm = engine.stage.units, engine.stage.wire.comm
        seen = {{"launches": 0, "misplaced": 0}}
        # a unit is one flat all-gather with its header on a device, copied out into its
        # full buffer (Note "gather check" in zero3/gather_check.py)
        def spy(output, input, *, label="", _call=comm.all_gather, **kwargs):
            if any(label == f"unit {{u.spec.name or '<root>'}}" for u in units):
                seen["launches"] += 1
            return _call(output, input, label=label, **kwargs)
        comm.all_gather = spy
        engine.comm.ledger.reset()
        with WritesInto(units) as writes:
            for step in range(2):
                x, y = R.micro_batch(step, 0, 0)
                engine.backward(engine(x.cuda(), y.cuda()))
                engine.step()
        torch.cuda.synchronize()
        out = {{**seen, "written": writes.written,
               "calls": engine.comm.ledger.calls["all_gather"]}}
        with zerotrain.zero.GatheredParameters(list(model.parameters())):
            out["weights"] = {{n: p.detach().float().cpu() for n, p in model.named_parameters()}}
        engine.close()
        return out

    plain, offload = run(False), run(True)
    diff = R.max_diff(plain.pop("weights"), offload.pop("weights"))
    print("RESULT " + json.dumps({{"plain": plain, "offload": offload, "diff": diff}}))
""")


def test_gathers_write_into_the_units_full_buffer_on_nccl(tmp_path):
    """Stage 3 bf16 on NCCL, with and without offload_param: one flat launch per unit gather
    (its header inside, copied out into the unit's full buffer), and the two runs train
    alike (CPU proxy: tests/dist/test_divergent_paths.py)."""
    import json
    script = tmp_path / "gather.py"
    script.write_text(GATHER_SCRIPT.format(here=HERE))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(next(l for l in out.stdout.splitlines()
                          if l.startswith("RESULT "))[len("RESULT "):])
    for case in ("plain", "offload"):
        got = res[case]
        assert got["launches"] > 0 and got["misplaced"] == 0, res
        assert got["calls"] == got["launches"], res   # one flat launch per unit gather
    assert res["diff"] <= 1e-2, res
