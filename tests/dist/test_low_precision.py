"""bf16 masters, gradients and Adam moments (``bf16.bf16_master_weights_and_grads`` with
``bf16_optimizer_states``) and ``torch_autocast`` at stages 1-3: 2 ranks against one process
with the same option, against DeepSpeed 0.19.8 where it is importable, the bytes a rank holds
(live storages), and a checkpoint saved on 2 ranks resumed on 1."""
import json
import os
import subprocess
import sys

import pytest
import torch

import low_precision_cases as C
from memory_probe import held_tensors, measure_two_steps

HERE = os.path.dirname(os.path.abspath(__file__))
# a folder holding a DeepSpeed 0.19.8 installation (pip install --target), or unset
DEEPSPEED_PATH = os.environ.get("ZEROTRAIN_DEEPSPEED_PATH", "")
# (stage, offload_optimizer)
CASES = [(1, False), (2, False), (3, False), (2, True), (3, True)]


def _engine(mode, stage, offload=False, ga=1):
    import zerotrain
    config = C.config(mode, stage, ga=ga)
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = zerotrain.initialize(model=C.model(), config=config)
    return engine


def _train(engine, mode, rank, world, first=0, steps=C.STEPS):
    """World 2: rank r takes micro-batch r; world 1: both, as two accumulated micro-steps."""
    losses = []
    for step in range(first, first + steps):
        total = 0.0
        for part in ([rank] if world == 2 else [0, 1]):
            loss = engine(*C.batch(mode, step, part))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / (1 if world == 2 else 2))
    return losses


def _full(engine):
    import zerotrain
    params = list(engine.module.parameters())
    with zerotrain.zero.GatheredParameters(params):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _runs(rank, world, mode, cases):
    out = {}
    for stage, offload in cases:
        engine = _engine(mode, stage, offload, ga=3 - world)
        losses = _train(engine, mode, rank, world)
        records = engine.stage.shard_records()
        out[(stage, offload)] = {
            "losses": losses, "weights": _full(engine),
            "params": sorted({str(p.dtype) for p in engine.module.parameters()}),
            "masters": sorted({str(r.master.dtype) for r in records}),
            "states": sorted({str(v.dtype) for r in records
                              for v in r.optimizer_state.values() if v.dim()}),
            "api": (engine.bf16_master_weights_and_gradients(), engine.bf16_optimizer_states(),
                    engine.torch_autocast_enabled(), str(engine.torch_autocast_dtype()))}
        engine.destroy()
    return out


def _diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.values(), b.values()))


def _close(a, b, tol):
    return _diff(a, b) <= tol


@pytest.mark.parametrize("mode, cases", [("bf16", CASES),
                                         ("bf16_autocast", [(1, False), (3, False)])])
def test_bf16_masters_at_stages_1_to_3_match_one_process(worlds, mode, cases):
    two = worlds.run(2, _runs, mode, cases)
    one = worlds.run(1, _runs, mode, cases)[0]
    for case in cases:
        got, ref = two[0][case], one[case]
        assert got["params"] == got["masters"] == got["states"] == ["torch.bfloat16"], case
        autocast = mode == "bf16_autocast"
        assert got["api"] == (True, True, autocast,
                              "torch.bfloat16" if autocast else "None"), got["api"]
        assert two[1][case]["weights"].keys() == got["weights"].keys()
        # bit for bit: two ranks' sum is rounded to bf16 once, as one process's sum of
        # its two micro-steps is (the parity tests' rule at world size 2)
        assert _close(got["weights"], ref["weights"], 0.0), (case, got, ref)
        mean = [(a + b) / 2 for a, b in zip(got["losses"], two[1][case]["losses"])]
        assert all(abs(a - b) <= 1e-2 for a, b in zip(mean, ref["losses"])), case


def test_torch_autocast_at_stages_1_to_3_matches_one_process(worlds):
    cases = [(1, False), (2, False), (3, False)]
    two = worlds.run(2, _runs, "autocast", cases)
    one = worlds.run(1, _runs, "autocast", cases)[0]
    plain = worlds.run(1, _plain_autocast)[0]
    for case in cases:
        got = two[0][case]
        assert got["params"] == got["masters"] == got["states"] == ["torch.float32"], case
        assert got["api"] == (False, False, True, "torch.bfloat16"), got["api"]
        assert _close(got["weights"], one[case]["weights"], 0.0), case
        # the engine's forward ran under autocast: the losses are those of the module
        # under torch.autocast(bfloat16), not of the fp32 module
        first = (got["losses"][0] + two[1][case]["losses"][0]) / 2
        assert first == pytest.approx(plain["autocast"], abs=1e-7), (first, plain)
        assert first != pytest.approx(plain["fp32"], abs=1e-5), (first, plain)


def _plain_autocast(rank, world):
    """The first step's mean loss over both micro-batches, with and without autocast."""
    model = C.model()
    losses = {}
    for name, on in (("autocast", True), ("fp32", False)):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            losses[name] = sum(model(*C.batch("autocast", 0, r)).item() for r in (0, 1)) / 2
    return losses


# ------------------------------------------------------------------ memory
def _measure(rank, world, bf16_states):
    import zerotrain
    from zerotrain.core.memory import live_tensor_bytes
    out = {}
    for stage in (1, 2, 3):
        held = held_tensors()
        baseline = live_tensor_bytes()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
        psi = sum(p.numel() for p in model.parameters())
        bf16 = {"enabled": True, "auto_cast": True}
        if bf16_states:
            bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        config = {"train_micro_batch_size_per_gpu": 2, "bf16": bf16,
                  "data_types": {"grad_accum_dtype": "bf16"},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000,
                                        "allgather_bucket_size": 20_000,
                                        "stage3_param_persistence_threshold": 0,
                                        "stage3_max_reuse_distance": 0}}
        engine, *_ = zerotrain.initialize(model=model, config=config)
        measured, breakdown = measure_two_steps(engine, torch.randn(2, 128), baseline)
        out[stage] = {"per_param": measured / psi, "breakdown": breakdown, "psi": psi}
        engine.destroy()
        del engine, model, held
    return out


def test_bf16_states_halve_the_optimizer_bytes_per_parameter(worlds):
    """After backward, bf16 parameters and gradients (N = 2): Adam with fp32 masters holds
    4 + 12/N, 2 + 14/N, 16/N bytes per parameter at stages 1, 2, 3; with bf16 masters and
    moments 4 + 6/N, 2 + 8/N, 8/N (at stage 3 the bf16 shard is the master)."""
    n = 2
    fp32 = worlds.run(n, _measure, False)
    bf16 = worlds.run(n, _measure, True)
    for rank in range(n):
        for stage, want_fp32, want_bf16 in ((1, 4 + 12 / n, 4 + 6 / n), (2, 2 + 14 / n, 2 + 8 / n),
                                            (3, 16 / n, 8 / n)):
            a, b = fp32[rank][stage], bf16[rank][stage]
            assert abs(a["per_param"] - want_fp32) <= 0.03 * want_fp32, (stage, a)
            assert abs(b["per_param"] - want_bf16) <= 0.03 * want_bf16, (stage, b)
            shard = b["psi"] / n
            state = b["breakdown"]["optimizer_state"]
            assert abs(state - (4 if stage == 3 else 6) * shard) <= 64, (stage, b)


# ------------------------------------------------------------------ checkpoints
def _save(rank, world, root, stage):
    engine = _engine("bf16", stage)
    _train(engine, "bf16", rank, world, steps=2)
    engine.save_checkpoint(root, tag="t")
    after = _train(engine, "bf16", rank, world, first=2, steps=2)
    out = {"losses": after, "weights": _full(engine)}
    engine.destroy()
    return out


def _resume(rank, world, root, stage):
    engine = _engine("bf16", stage, ga=3 - world)
    engine.load_checkpoint(root, tag="t")
    records = engine.stage.shard_records()
    dtypes = sorted({str(v.dtype) for r in records for v in
                     [r.master, *r.optimizer_state.values()] if v.dim()})
    steps = engine.global_steps
    after = _train(engine, "bf16", rank, world, first=2, steps=2)
    out = {"losses": after, "weights": _full(engine), "dtypes": dtypes, "steps": steps}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_states_checkpoint_resumes_on_another_world_size(worlds, tmp_path, stage):
    root = str(tmp_path / "ckpt")
    saved = worlds.run(2, _save, root, stage)[0]
    again = worlds.run(2, _resume, root, stage)[0]
    assert again["dtypes"] == ["torch.bfloat16"] and again["steps"] == 2
    assert again["losses"] == saved["losses"]          # same world: bit for bit
    assert _close(again["weights"], saved["weights"], 0.0)
    one = worlds.run(1, _resume, root, stage)[0]      # resharded 2 -> 1
    assert one["dtypes"] == ["torch.bfloat16"] and one["steps"] == 2
    assert _close(one["weights"], saved["weights"], 2 ** -7), (one, saved)


# ------------------------------------------------------------------ refusals
def _refused(rank, world, mode, stage, update):
    import zerotrain
    config = C.config(mode, stage)
    for section, values in update.items():
        config.setdefault(section, {}).update(values)
    try:
        zerotrain.initialize(model=C.model(), config=config)
    except zerotrain.ConfigError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize("mode, stage, update, message", [
    ("bf16", 0, {}, r"^bf16.bf16_master_weights_and_grads: .*only supported with ZeRO Stage "
                    r"1, 2, or 3"),
    ("bf16", 2, {"bf16": {"bf16_optimizer_states": False}},
     r"^bf16.bf16_master_weights_and_grads: without bf16.bf16_optimizer_states .*not implement"),
    ("autocast", 2, {"torch_autocast": {"lower_precision_safe_modules": None}},
     r"^torch_autocast.lower_precision_safe_modules: .*'inp.weight'.*not implement"),
    ("autocast", 2, {"torch_autocast": {"dtype": "float16"}},
     r"^torch_autocast.dtype: fp16 autocast .*not implemented"),
])
def test_low_precision_combinations_not_implemented_are_refused_by_name(worlds, mode, stage,
                                                                        update, message):
    import re
    for text in worlds.run(2, _refused, mode, stage, update):
        assert re.search(message, text), text


# ------------------------------------------------------------------ DeepSpeed
def _deepspeed_importable() -> bool:
    env = dict(os.environ, PYTHONPATH=DEEPSPEED_PATH)
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], env=env,
                           capture_output=True, timeout=120)
    return probe.returncode == 0


@pytest.mark.slow
def test_low_precision_matches_deepspeed_at_stages_1_to_3(worlds, tmp_path):
    """DeepSpeed 0.19.8 on 2 CPU ranks, the same model, data and options (bf16 masters alone
    and under a bf16 autocast, autocast over fp32 parameters with every gradient reduced in
    fp32): the same losses and weights, bit for bit."""
    if not _deepspeed_importable():
        pytest.skip(f"DeepSpeed is not importable from {DEEPSPEED_PATH or 'this environment'} "
                    "(ZEROTRAIN_DEEPSPEED_PATH)")
    out = tmp_path / "ds.json"
    tests = os.path.dirname(HERE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([DEEPSPEED_PATH, tests]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                          "2", "--standalone",
                          os.path.join(tests, "ds_scripts", "low_precision_ds.py"), str(out)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(out.read_text())
    stages = [(1, False), (2, False), (3, False)]
    ours = {mode: worlds.run(2, _runs, mode, stages)[0] for mode in C.MODES}
    for mode in C.MODES:
        for stage, _ in stages:
            ds = theirs[f"{mode}/{stage}"]
            zt = ours[mode][(stage, False)]
            weights = {n: torch.tensor(v) for n, v in ds["weights"].items()}
            # bit for bit: the same bf16 roundings in the same order (measured so on 2
            # CPU ranks), the fp32 reductions of autocast too
            assert _close(zt["weights"], weights, 0.0), (mode, stage, zt, ds)
            assert zt["losses"] == ds["losses"], (mode, stage, zt["losses"], ds["losses"])


def _client_cpu_adam(rank, world, fp32_states):
    import zerotrain
    from zerotrain.ops.adam import DeepSpeedCPUAdam
    config = C.config("bf16", 2)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    params = dict(config.pop("optimizer")["params"])
    params["betas"] = tuple(params["betas"])
    model = C.model()
    client = DeepSpeedCPUAdam(model.parameters(), fp32_optimizer_states=fp32_states, **params)
    try:
        engine, *_ = zerotrain.initialize(model=model, optimizer=client, config=config)
    except zerotrain.ConfigError as exc:
        return {"error": str(exc), "assertion": isinstance(exc, AssertionError)}
    _train(engine, "bf16", rank, world)
    out = {"weights": _full(engine)}
    engine.destroy()
    return out


def test_client_cpu_adam_with_bf16_states_needs_16bit_moments_as_in_deepspeed(worlds):
    """Offloaded, a client DeepSpeedCPUAdam must be built with fp32_optimizer_states=False
    beside bf16_optimizer_states (DeepSpeed asserts it); so built it trains as the config's
    optimizer does."""
    refused = worlds.run(2, _client_cpu_adam, True)[0]
    assert refused["assertion"] and refused["error"].startswith(
        "bf16.bf16_optimizer_states: bf16_optimizer_states with ZeRO-Offload requires "
        "DeepSpeedCPUAdam constructed with fp32_optimizer_states=False"), refused
    client = worlds.run(2, _client_cpu_adam, False)[0]
    config = worlds.run(2, _runs, "bf16", [(2, True)])[0][(2, True)]
    assert _close(client["weights"], config["weights"], 0.0)
