"""Muon under ZeRO: ``"optimizer": {"type": "Muon"}`` (DeepSpeed's MuonWithAuxAdam) and a
client ``torch.optim.Muon`` at stages 0-3 on 2 and 3 gloo ranks against one process, with
optimizer offload, a checkpoint saved at 2 ranks and resumed at 3, and, when DeepSpeed is
importable, against DeepSpeed 0.19.8's own Muon at stage 1."""
import importlib.util

import pytest
import torch

import reference as R

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
MUON = {"lr": 1e-2, "muon_lr": 0.02, "weight_decay": 0.01, "momentum": 0.9}
STEPS = 3
# (name, stage, extra zero_optimization keys, client torch.optim.Muon)
CASES = [("s0", 0, {}, False), ("s1", 1, {}, False), ("s2", 2, {}, False), ("s3", 3, {}, False),
         ("s2_offload", 2, {"offload_optimizer": {"device": "cpu"}}, False),
         ("s3_offload", 3, {"offload_optimizer": {"device": "cpu"}}, False),
         ("s2_torch", 2, {}, True)]


def reference(worlds, *, torch_muon=False):
    """One process: each step averages the ranks' gradients (``R.micro_batch``) and steps
    every parameter whole, Muon for matrices and DeepSpeed's inline AdamW for the rest."""
    from zerotrain.muon.newton_schulz import deepspeed_orthogonalize
    model = R.make_model()
    state = {}
    params = dict(model.named_parameters())
    for step, world in enumerate(worlds):
        grads = {n: torch.zeros_like(p) for n, p in params.items()}
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            model(*R.micro_batch(step, rank, 0)).backward()
            for n, p in params.items():
                grads[n].add_(p.grad)
        with torch.no_grad():
            for n, p in params.items():
                g = grads[n].div_(world)
                s = state.setdefault(n, {})
                if torch_muon and p.ndim < 2:   # frozen in that run
                    continue
                if torch_muon:
                    t = s.setdefault("opt", torch.optim.Muon([p], lr=0.02, weight_decay=0.01,
                                                             momentum=0.9))
                    p.grad = g
                    t.step()
                    continue
                if p.ndim >= 2:
                    buf = s.setdefault("m", torch.zeros_like(p))
                    buf.lerp_(g, 1 - MUON["momentum"])
                    u = deepspeed_orthogonalize(g.lerp(buf, MUON["momentum"]))
                    p.mul_(1 - MUON["muon_lr"] * MUON["weight_decay"])
                    p.add_(u, alpha=-MUON["muon_lr"])
                else:
                    a, b = s.setdefault("a", torch.zeros_like(p)), s.setdefault("b", torch.zeros_like(p))
                    s["t"] = s.get("t", 0) + 1
                    a.lerp_(g, 0.1)
                    b.lerp_(g.square(), 0.05)
                    u = (a / (1 - 0.9 ** s["t"])) / ((b / (1 - 0.95 ** s["t"])).sqrt() + 1e-10)
                    p.mul_(1 - MUON["lr"] * MUON["weight_decay"])
                    p.add_(u, alpha=-MUON["lr"])
    return {n: p.detach().clone() for n, p in params.items()}


def _config(stage, zero_extra):
    cfg = R.engine_config(stage=stage, optimizer={"type": "Muon", "params": dict(MUON)})
    cfg["zero_optimization"].update(zero_extra)
    if zero_extra:
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def _engine(stage, zero_extra, client, seed=0):
    import zerotrain
    model = R.make_model(seed)
    if client:
        matrices = [p for p in model.parameters() if p.ndim >= 2]
        for p in model.parameters():
            p.requires_grad_(p.ndim >= 2)
        opt = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01, momentum=0.9)
        config = R.engine_config(stage=stage)
        config.pop("optimizer")
        return zerotrain.initialize(model=model, optimizer=opt, config=config)[0]
    return zerotrain.initialize(model=model, config=_config(stage, zero_extra))[0]


def _weights(engine):
    import zerotrain
    with zerotrain.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _train(engine, rank, first, steps):
    for step in range(first, first + steps):
        engine.backward(engine(*R.micro_batch(step, rank, 0)))
        engine.step()


def _cases_job(rank, world):
    out = {}
    for name, stage, extra, client in CASES:
        engine = _engine(stage, extra, client)
        _train(engine, rank, 0, STEPS - 1)
        engine.comm.ledger.reset()
        _train(engine, rank, STEPS - 1, 1)
        out[name] = {"weights": _weights(engine),
                     "bytes": dict(engine.comm.ledger.nbytes)}
        engine.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_muon_stages_1_to_3_offload_and_torch_muon_match_one_process(worlds, world):
    results = worlds.run(world, _cases_job)
    expected = reference([world] * STEPS)
    expected_torch = reference([world] * STEPS, torch_muon=True)
    for name, stage, extra, client in CASES:
        for rank_result in results:
            got = rank_result[name]["weights"]
            want = expected_torch if client else expected
            assert R.max_diff(got, want) <= 1e-5, (name, R.max_diff(got, want))
    # the Muon exchange: two all_to_alls, each carrying every rank's chunk of every matrix
    # (fp32): over the ranks 2 * world * sum(ceil(numel / world)) elements, ~2M in all
    chunks = sum(-(-p.numel() // world) for p in R.make_model().parameters() if p.ndim >= 2)
    for name in ("s1", "s2", "s3"):
        moved = [r[name]["bytes"] for r in results]
        assert sum(m["all_to_all"] for m in moved) == 2 * 4 * world * chunks, (name, moved)
    print({name: results[0][name]["bytes"] for name in ("s1", "s2", "s3")})


def _save_job(rank, world, root):
    engine = _engine(2, {}, False)
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(root)
    state = engine.optimizer.state_dict()["state"]
    return sorted({k for s in state.values() for k in s})


def _resume_job(rank, world, root, stage):
    engine = _engine(stage, {}, False, seed=7)
    engine.load_checkpoint(root)
    _train(engine, rank, 2, 2)
    return _weights(engine)


@pytest.mark.slow
def test_muon_checkpoint_saved_at_2_ranks_resumes_at_3(worlds, tmp_path):
    keys = worlds.run(2, _save_job, str(tmp_path))
    assert "momentum_buffer" in keys[0] and "exp_avg" in keys[0], keys
    expected = reference([2, 2, 3, 3])
    for stage in (1, 3):
        for got in worlds.run(3, _resume_job, str(tmp_path), stage):
            assert R.max_diff(got, expected) <= 1e-5, (stage, R.max_diff(got, expected))


def _deepspeed_job(rank, world):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    # torch_adam: the AdamW half is torch's (DeepSpeed would otherwise build its FusedAdam
    # op for the CPU first); the arithmetic is the same Adam
    config = R.engine_config(stage=1, optimizer={"type": "Muon",
                                                 "params": dict(MUON, torch_adam=True)})
    for key in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"):
        config["zero_optimization"].pop(key)
    model = R.make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    _train(engine, rank, 0, STEPS)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _stage1_job(rank, world):
    engine = _engine(1, {}, False)
    _train(engine, rank, 0, STEPS)
    return _weights(engine)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not importable")
def test_muon_matches_deepspeed_at_stage_1(worlds):
    from distributed import run_world
    ours = worlds.run(2, _stage1_job)
    assert R.max_diff(ours[0], reference([2] * STEPS)) <= 1e-5
    for got in run_world(_deepspeed_job, 2, timeout=600):
        assert R.max_diff(got, ours[0]) <= 1e-5, R.max_diff(got, ours[0])
