"""Offload trains exactly like no offload: optimizer state in host RAM or NVMe files
(stages 1-3), stage-3 parameter shards on the host, checkpoints, and the delayed update.

Every case runs on gloo CPU processes, where "the host" is the training device, so what is
compared is the offload path itself: the state in its own (pinned or file-backed) tensors,
torch's fused CPU Adam stepping record by record, NVMe swaps through the slots, and the
refresh of the parameters from the host masters.
"""
import os

import pytest

import reference as R

STEPS = 3


def _offload(kind: str, nvme_dir: str) -> dict:
    if kind == "none":
        return {}
    if kind == "cpu":
        return {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if kind == "nvme":
        return {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir}}
    if kind == "cpu+param":
        return {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    if kind == "nvme+param":
        return {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir},
                "offload_param": {"device": "cpu"}}
    if kind == "nvme+nvme":
        return {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir},
                "offload_param": {"device": "nvme", "nvme_path": nvme_dir}}
    raise ValueError(kind)


def _train(rank, stage, kind, ga, clip, nvme_dir, precision="fp32", zero_init=False,
           steps=STEPS, **zero):
    import torch
    import zerotrain
    config = R.engine_config(stage=stage, ga=ga, clip=clip, precision=precision)
    config["zero_optimization"].update(_offload(kind, nvme_dir), **zero)
    if zero_init:
        torch.manual_seed(0)
        with zerotrain.zero.Init():
            model = R.TinyNet()
    else:
        model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    R.train_engine(engine, steps=steps, rank=rank, ga=ga)
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        got = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.close()
    return got


CASES = [(stage, kind, ga, clip)
         for stage in (1, 2, 3)
         for kind in (("cpu", "nvme") + (("cpu+param", "nvme+param", "nvme+nvme")
                                          if stage == 3 else ()))
         for ga, clip in ((1, 0.0), (2, 0.5))]


def _grid(rank, world, nvme_dir, cases):
    out = []
    for stage, kind, ga, clip in cases:
        base = _train(rank, stage, "none", ga, clip, nvme_dir)
        got = _train(rank, stage, kind, ga, clip, nvme_dir, zero_init=(stage == 3 and ga == 2))
        ref = R.reference_accumulate(steps=STEPS, world=world, ga=ga, clip=clip)
        out.append({"case": (stage, kind, ga, clip), "vs_plain": R.max_diff(got, base),
                    "vs_reference": R.max_diff(got, ref)})
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_offload_matches_no_offload(worlds, world, tmp_path):
    per_rank = worlds.run(world, _grid, str(tmp_path), CASES)
    for rank, results in enumerate(per_rank):
        for res in results:
            where = f"rank {rank} world {world} case {res['case']}"
            assert res["vs_plain"] <= 1e-6, where
            assert res["vs_reference"] <= 1e-5, where
    assert os.listdir(tmp_path) == [], "NVMe swap directories must be removed by close()"


def _bf16(rank, world, nvme_dir):
    out = {}
    for stage, kind in ((2, "cpu"), (2, "nvme"), (3, "cpu+param")):
        base = _train(rank, stage, "none", 2, 0.5, nvme_dir, precision="bf16")
        got = _train(rank, stage, kind, 2, 0.5, nvme_dir, precision="bf16")
        out[(stage, kind)] = R.max_diff(got, base)
    return out


def test_offload_bf16_tracks_no_offload(worlds, tmp_path):
    """bf16 parameters come from fp32 masters on either side; the host step may round the
    last fp32 bit differently (fused Adam), which can move a bf16 value by one unit."""
    for res in worlds.run(2, _bf16, str(tmp_path)):
        for case, diff in res.items():
            assert diff <= 1e-2, case


# --------------------------------------------------------------------------- NVMe files
def _swap_files(rank, world, nvme_dir):
    import zerotrain
    config = R.engine_config(stage=2)
    config["zero_optimization"].update(_offload("nvme", nvme_dir))
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    R.train_engine(engine, steps=1, rank=rank, ga=1)
    swap_dir = engine.stage.storage.path
    during = (os.path.isdir(swap_dir), os.listdir(swap_dir), engine.stage.storage.reserved_bytes)
    engine.close()
    return during + (os.path.exists(swap_dir),)


def test_nvme_swap_files_are_reserved_and_removed(worlds, tmp_path):
    for exists, listed, reserved, after in worlds.run(2, _swap_files, str(tmp_path)):
        assert exists and listed == []          # unlinked once mapped: gone even on a crash
        shard = sum(p.numel() for p in R.make_model().parameters()) / 2
        assert reserved >= 3 * 4 * shard        # master, exp_avg, exp_avg_sq in fp32
        assert not after


# --------------------------------------------------------------------------- checkpoints
def _resume(rank, world, nvme_dir, save_dir, stage, kind):
    import zerotrain

    def engine_for(kind_):
        config = R.engine_config(stage=stage, ga=1, clip=0.5)
        config["zero_optimization"].update(_offload(kind_, nvme_dir))
        engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
        return engine

    def params(engine):
        with zerotrain.zero.GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    whole = engine_for(kind)
    for step in range(4):
        whole.backward(whole(*R.micro_batch(step, rank, 0)))
        whole.step()
        if step == 1:
            whole.save_checkpoint(save_dir, tag="mid")
    expected = params(whole)
    whole.close()
    out = {}
    for resume_kind in (kind, "none"):
        again = engine_for(resume_kind)
        again.load_checkpoint(save_dir, tag="mid")
        for step in range(2, 4):
            again.backward(again(*R.micro_batch(step, rank, 0)))
            again.step()
        out[resume_kind] = R.max_diff(params(again), expected)
        again.close()
    return out


@pytest.mark.parametrize("stage,kind", [(2, "nvme"), (3, "cpu+param"), (3, "nvme")])
def test_offloaded_checkpoint_resumes_exactly(worlds, tmp_path, stage, kind):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    for res in worlds.run(2, _resume, str(nvme), str(tmp_path / "ckpt"), stage, kind):
        assert res[kind] == 0.0, res            # same placement: bit-exact
        assert res["none"] <= 1e-6, res         # into no offload: the same values


# --------------------------------------------------------------------------- delayed update
WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3,
          "warmup_type": "linear"}


def _delayed_reference(world, steps, lr=1e-2):
    """ZeRO-Offload's delayed parameter update: step t's gradient is taken at the
    parameters published before step t-1's update finished; update t uses step t's lr."""
    import torch
    from zerotrain.schedules import build_scheduler
    model = R.make_model()
    params = list(model.parameters())
    masters = [p.detach().clone() for p in params]
    opt = R.adamw(masters, lr=lr)
    scheduler = build_scheduler("WarmupLR", WARMUP, opt)
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            model(*R.micro_batch(step, rank, 0)).backward()
            for t, p in zip(total, params):
                t.add_(p.grad)
        with torch.no_grad():
            for p, m in zip(params, masters):   # the update of step t-1 lands
                p.copy_(m)
        for m, t in zip(masters, total):
            m.grad = t.div_(world) if world > 1 else t
        opt.step()
        scheduler.step()
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _dpu(rank, world, nvme_dir, stage, device):
    import zerotrain
    config = R.engine_config(stage=stage)
    offload = {"device": device, "dpu": True}
    if device == "nvme":
        offload["nvme_path"] = nvme_dir
    config["zero_optimization"]["offload_optimizer"] = offload
    config["scheduler"] = {"type": "WarmupLR", "params": WARMUP}
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    R.train_engine(engine, steps=5, rank=rank, ga=1)
    engine.eval()   # settles the pending update
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return R.max_diff(got, _delayed_reference(world, 5)), R.max_diff(got, _undelayed(world, 5))


def _undelayed(world, steps):
    """The same run without the delay: what the flag changes."""
    from zerotrain.schedules import build_scheduler
    model = R.make_model()
    opt = R.adamw(model.parameters())
    scheduler = build_scheduler("WarmupLR", WARMUP, opt)
    params = list(model.parameters())
    for step in range(steps):
        grads = None
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            model(*R.micro_batch(step, rank, 0)).backward()
            grads = [p.grad.clone() if grads is None else g + p.grad
                     for g, p in zip(grads or [None] * len(params), params)]
        for p, g in zip(params, grads):
            p.grad = g / world
        opt.step()
        scheduler.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage,device", [(2, "cpu"), (3, "nvme")])
def test_delayed_update_is_the_one_step_delay(worlds, tmp_path, stage, device):
    for delayed, plain in worlds.run(2, _dpu, str(tmp_path), stage, device):
        assert delayed <= 1e-6
        assert plain > 1e-4     # it is a different algorithm, not a no-op flag


# --------------------------------------------------------------------------- where state lives
def _breakdown(rank, world, nvme_dir):
    import zerotrain
    out = {}
    for stage, kind in ((2, "cpu"), (2, "nvme"), (3, "cpu+param"), (3, "nvme+nvme")):
        config = R.engine_config(stage=stage, precision="bf16")
        config["zero_optimization"].update(_offload(kind, nvme_dir))
        engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
        R.train_engine(engine, steps=2, rank=rank, ga=1)
        records = engine.stage.shard_records()
        shard = sum(r.master.numel() for r in records)
        out[(stage, kind)] = (engine.memory_breakdown(), shard, len(records))
        times = engine.timing_breakdown()
        assert times["offload_cpu_adam"] > 0 and times["forward"] > 0, times
        engine.close()
    return out


def test_offloaded_state_is_12_bytes_per_shard_element_off_the_device(worlds, tmp_path):
    """fp32 master + exp_avg + exp_avg_sq, counted by storage; nothing else is kept there
    (no fp32 gradient copy), and the device keeps no optimizer state."""
    for res in worlds.run(2, _breakdown, str(tmp_path)):
        for (stage, kind), (held, shard, records) in res.items():
            where = "nvme_optimizer_state" if kind.startswith("nvme") else "host_optimizer_state"
            steps = 4 * records                     # Adam's fp32 step counter per record
            assert held.get(where) == 12 * shard + steps, (stage, kind, held)
            assert held.get("optimizer_state", 0) == 0, (stage, kind, held)
            if stage == 3:
                params = "nvme_parameters" if kind == "nvme+nvme" else "host_parameters"
                assert held[params] == 2 * shard, (stage, kind, held)   # bf16 shard
