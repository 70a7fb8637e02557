"""On a CUDA machine: the offload paths (pinned host state, device-to-host gradient staging,
asynchronous host-to-device refresh, NVMe swapping) train like no offload, at stages 1-3;
the device follows LOCAL_RANK whatever the group's backend string; copies run on their own
streams; the copy ledger counts 2 bytes per shard element each way at stage 2 bf16; every
stage trains on CUDA like the same stage on CPU (within a stated tolerance); zero.Init builds
on the GPU; the CUDA-event step timers report.

Skipped without CUDA (CI has none; tests/unit/test_devices.py and
tests/dist/test_offload_copies.py check the same decisions and counts on CPU). One process,
world size 1; run with ``pytest -m gpu tests/gpu``.
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
# tests/: where reference.py lives for the child scripts
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what every child script starts with: imports and the full weights after training
PRELUDE = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {here!r})
    import zerotrain, reference as R

    def full_weights(engine, model, dtype=torch.float32):
        \"\"\"Every parameter gathered and copied to the host; then the engine is closed.\"\"\"
        engine.eval()
        with zerotrain.zero.GatheredParameters(list(model.parameters())):
            out = {{n: p.detach().to(dtype).cpu() for n, p in model.named_parameters()}}
        engine.close()
        return out
""")


def _run_script(tmp_path, name: str, body: str, *argv: str) -> dict:
    """Run ``PRELUDE + body`` in a fresh process; the dict it printed after ``RESULT``."""
    script = tmp_path / f"{name}.py"
    script.write_text((PRELUDE + body).format(here=HERE, nvme=str(tmp_path)))
    out = subprocess.run([sys.executable, str(script), *argv], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(next(line for line in out.stdout.splitlines()
                           if line.startswith("RESULT "))[len("RESULT "):])


SCRIPT = textwrap.dedent("""
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
        return full_weights(engine, model)

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


# fp32: both runs compute forward and backward with the same CUDA kernels; only the
# optimizer step differs (no offload: torch's CUDA fused AdamW; offload: the host AdamW),
# and two AdamW kernels round m / (sqrt(v) + eps) differently (fused multiply-adds, the
# order of the bias corrections): ~1e-7 relative per element per step. Four steps at lr
# 1e-2 on weights of order 0.1-1 keep that under 1e-5; a wrong shard, a stale publish or a
# missed step moves weights by ~lr = 1e-2. bf16: the parameters themselves round at 8 bits.
FP32_OFFLOAD_TOL = 1e-5
BF16_OFFLOAD_TOL = 1e-2


def test_offload_on_cuda_matches_no_offload(tmp_path):
    results = _run_script(tmp_path, "cuda_offload", SCRIPT)
    for case, diff in results.items():
        if case.startswith("fp32"):
            assert diff <= FP32_OFFLOAD_TOL, (case, diff)
        elif case.startswith("bf16"):
            assert diff <= BF16_OFFLOAD_TOL, (case, diff)


DEVICE_SCRIPT = textwrap.dedent("""
    import os, torch.distributed as dist
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
    res = _run_script(tmp_path, "devices", DEVICE_SCRIPT, backend)
    last = torch.cuda.device_count() - 1
    assert res["device"] == res["comm"] == f"cuda:{last}" and res["current"] == last, res
    assert res["copies"] == {"to_host": 2 * 2 * res["shard"],
                             "to_device": 2 * 2 * res["shard"]}, res
    assert res["upload_exact"] and res["send_exact"], res
    assert res["streams"] == ["to_device", "to_host"], res


GATHER_SCRIPT = textwrap.dedent("""
    import torch.distributed as dist
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
        return {{**seen, "written": writes.written,
                "calls": engine.comm.ledger.calls["all_gather"],
                "weights": full_weights(engine, model)}}

    plain, offload = run(False), run(True)
    diff = R.max_diff(plain.pop("weights"), offload.pop("weights"))
    print("RESULT " + json.dumps({{"plain": plain, "offload": offload, "diff": diff}}))
""")


def test_gathers_write_into_the_units_full_buffer_on_nccl(tmp_path):
    """Stage 3 bf16 on NCCL, with and without offload_param: one flat launch per unit gather
    (its header inside, copied out into the unit's full buffer), and the two runs train
    alike (CPU proxy: tests/dist/test_divergent_paths.py)."""
    res = _run_script(tmp_path, "gather", GATHER_SCRIPT)
    for case in ("plain", "offload"):
        got = res[case]
        assert got["launches"] > 0 and got["misplaced"] == 0, res
        assert got["calls"] == got["launches"], res   # one flat launch per unit gather
    assert res["diff"] <= 1e-2, res


INIT_SCRIPT = textwrap.dedent("""
    from zerotrain.stages.zero3.partition import is_partitioned

    def run(init):
        config = R.engine_config(stage=3)
        torch.manual_seed(0)
        if init:
            with torch.device("cuda"), zerotrain.zero.Init(config_dict_or_path=config):
                model = R.TinyNet()
        else:
            with torch.device("cuda"):
                model = R.TinyNet()
        out = {{"partitioned": all(is_partitioned(p) for p in model.parameters()),
               "devices": sorted({{str(p.device) for p in model.parameters()}})}}
        engine, *_ = zerotrain.initialize(model=model, config=config)
        R.train_engine(engine, steps=3, rank=0, ga=1)
        out["timers"] = engine.timing_breakdown()
        out["weights"] = full_weights(engine, model)
        return out

    built, init = run(False), run(True)
    print("RESULT " + json.dumps({{
        "init_partitioned": init["partitioned"], "init_devices": init["devices"],
        "timers": init["timers"], "diff": R.max_diff(built.pop("weights"),
                                                     init.pop("weights"))}}))
""")


def test_zero_init_on_cuda_trains_like_a_model_built_whole(tmp_path):
    """zero.Init under torch.device("cuda") partitions every parameter on the GPU and trains
    like the same model built whole and handed to stage 3 (same seed, same CUDA kernels:
    only the order of cuBLAS reductions could differ, hence 1e-6 in fp32); the step timers
    (CUDA events) report forward, backward and step."""
    res = _run_script(tmp_path, "init", INIT_SCRIPT)
    assert res["init_partitioned"] and res["init_devices"] == ["cuda:0"], res
    assert res["diff"] <= 1e-6, res
    assert all(res["timers"].get(part, 0) > 0 for part in ("forward", "backward", "step")), res


STAGES_SCRIPT = textwrap.dedent("""
    torch.backends.cuda.matmul.allow_tf32 = False   # fp32 matmuls in fp32 on both devices
    torch.backends.cudnn.allow_tf32 = False

    def run(stage, device):
        config = R.engine_config(stage=stage, ga=2)
        config["optimizer"] = {{"type": "SGD", "params": {{"lr": 0.1}}}}
        model = R.make_model().to(device)
        engine, *_ = zerotrain.initialize(model=model, config=config)
        R.train_engine(engine, steps=4, rank=0, ga=2)
        return full_weights(engine, model, torch.float64)

    print("RESULT " + json.dumps({{stage: R.max_diff(run(stage, "cuda"), run(stage, "cpu"))
                                  for stage in range(4)}}))
""")
# CUDA and CPU kernels sum a matmul's products in different orders (~1e-7 relative per
# element in fp32, TF32 off); SGD carries such differences linearly (Adam's m / sqrt(v)
# could turn a near-zero gradient's rounding into a step of lr), so after 4 steps at lr 0.1
# they stay far below 1e-5, while a wrong shard, a stale publish or a lost micro-batch moves
# a weight by ~1e-2.
STAGE_DEVICE_TOL = 1e-5


def test_every_stage_on_cuda_trains_like_the_same_stage_on_cpu(tmp_path):
    res = _run_script(tmp_path, "stages", STAGES_SCRIPT)
    assert sorted(res) == ["0", "1", "2", "3"], res
    assert all(diff <= STAGE_DEVICE_TOL for diff in res.values()), res
