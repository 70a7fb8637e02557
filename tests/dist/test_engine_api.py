"""The DeepSpeed-style API: what initialize returns, accessors, client objects, errors."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import reference as R
from distributed import run_world


def _accessors(rank, world):
    import zerotrain
    model = R.make_model()
    config = R.engine_config(stage=1, ga=2, clip=1.0, precision="bf16")
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                          "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 4,
                                                          "warmup_type": "linear"}}
    engine, optimizer, loader, scheduler = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config=config)
    lrs, boundaries, applied = [], [], []
    for micro in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(*R.micro_batch(0, rank, micro)))
        engine.step()
        lrs.append(engine.get_lr()[0])
        applied.append(engine.was_step_applied())
    try:
        engine.scale(torch.ones(2))
    except AssertionError as exc:   # DeepSpeed asserts it; zerotrain's is a ValueError too
        applied.append(isinstance(exc, ValueError) and "scalar tensor" in str(exc))
    with zerotrain.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        pass
    engine.eval()
    eval_mode = not model.training
    engine.train()
    return {
        "types": (type(optimizer).__name__, type(optimizer.optimizer).__name__,
                  type(scheduler).__name__, loader),
        "sizes": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                  engine.gradient_accumulation_steps()),
        "stage": engine.zero_optimization_stage(), "bf16": engine.bfloat16_enabled(),
        "fp16": engine.fp16_enabled(), "steps": (engine.global_steps, engine.micro_steps,
                                                 engine.skipped_steps),
        "boundaries": boundaries, "lrs": lrs, "lr_groups": optimizer.param_groups[0]["lr"],
        "norm": engine.get_global_grad_norm(), "applied": applied,
        "loss_scale": engine.loss_scale, "eval_mode": eval_mode,
        "module_attr": engine.hidden is model.hidden, "local_rank": engine.local_rank,
        "memory": sorted(engine.memory_breakdown()),
    }


def test_initialize_returns_deepspeed_tuple_and_accessors(worlds):
    for rank, res in enumerate(worlds.run(2, _accessors)):
        assert res["types"] == ("ZeroOptimizer", "AdamW", "WarmupLR", None)
        assert res["sizes"] == (16, 4, 2) and res["stage"] == 1
        assert res["bf16"] and not res["fp16"] and res["loss_scale"] == 1.0
        assert res["steps"] == (2, 4, 0)
        assert res["boundaries"] == [False, True, False, True]
        # WarmupLR (DeepSpeed's semantics): construction sets warmup_min_lr, the scheduler
        # steps at boundaries only, and iteration i gives min + (max - min) * i / warmup
        assert res["lrs"] == pytest.approx([0.0, 0.0, 0.0, 0.0025])
        assert res["lr_groups"] == pytest.approx(0.0025)
        assert res["norm"] > 0 and res["eval_mode"] and res["module_attr"]
        # was_step_applied: the latest step() only (none between boundaries); scale(): scalars
        assert res["applied"] == [False, True, False, True, True]
        assert res["local_rank"] == rank
        assert res["memory"] == ["buffers", "gradients", "optimizer_state", "parameters"]


def _client_objects(rank, world):
    import zerotrain
    results = {}
    for kind in ("config", "client", "both"):
        model = R.make_model()
        config = R.engine_config(stage=2)
        optimizer = None
        scheduler = None
        if kind == "client":
            config.pop("optimizer")
        if kind == "both":   # as in DeepSpeed, the client's objects win, with a warning
            config["optimizer"]["params"]["lr"] = 0.5
            config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
        if kind != "config":
            optimizer = R.adamw(model.parameters())
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, opt, _, sched = zerotrain.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        results[f"{kind}_warnings"] = [str(w.message) for w in caught
                                       if "take precedence" in str(w.message)]
        R.train_engine(engine, steps=3, rank=rank, ga=1)
        results[kind] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if kind != "config":
            results[f"{kind}_same_object"] = opt.optimizer is optimizer and sched is scheduler
            results[f"{kind}_lr"] = engine.get_lr()[0]
            results["params_are_shards"] = all(
                p.dim() == 1 for g in optimizer.param_groups for p in g["params"])
    return results


def test_client_optimizer_and_scheduler_are_retargeted_at_the_shards(worlds):
    for rank, res in enumerate(worlds.run(2, _client_objects)):
        assert res["client_same_object"] and res["both_same_object"]
        assert res["params_are_shards"]
        assert res["client_lr"] == res["both_lr"] == pytest.approx(1e-2 / 4)  # LambdaLR, 3 steps
        # LambdaLR lowers the lr after step 1, so the runs differ only from step 2 on
        assert R.max_diff(res["config"], res["client"]) > 0
        assert R.max_diff(res["client"], res["both"]) == 0.0   # the config's sections unused
        assert res["config_warnings"] == res["client_warnings"] == []
        assert len(res["both_warnings"]) == (rank == 0), res["both_warnings"]
        if rank == 0:
            assert "'optimizer' and 'scheduler' sections are not used" in res["both_warnings"][0]


def _groups_and_frozen(rank, world):
    import zerotrain
    model = R.make_model()
    model.norm.weight.requires_grad_(False)
    frozen = model.norm.weight.detach().clone()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    engine, opt, _, _ = zerotrain.initialize(model=model, model_parameters=groups,
                                             config=R.engine_config(stage=2))
    R.train_engine(engine, steps=2, rank=rank, ga=1)
    return {"frozen_unchanged": torch.equal(frozen, model.norm.weight.detach()),
            "decays": [g["weight_decay"] for g in opt.param_groups],
            "n_groups": len(engine.stage.groups),
            "trainable_in_layout": sum(len(g.params) for g in engine.stage.groups)}


def test_parameter_groups_keep_hyperparameters_and_frozen_parameters_stay(worlds):
    for res in worlds.run(2, _groups_and_frozen):
        assert res["frozen_unchanged"] and res["decays"] == [0.1, 0.0]
        assert res["n_groups"] == 2 and res["trainable_in_layout"] == 7


class _Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((R.IN,), float(i)), torch.zeros(R.OUT)


def _loader(rank, world):
    import zerotrain
    model = R.make_model()
    engine, _, loader, _ = zerotrain.initialize(model=model, training_data=_Pairs(),
                                                config=R.engine_config(stage=0))
    seen = []
    for x, y in loader:
        assert x.shape == (4, R.IN)
        engine.backward(engine(x, y))
        engine.step()
        seen += x[:, 0].int().tolist()
    return {"len": len(loader), "seen": seen}


def test_training_data_gives_disjoint_micro_batches_per_rank(worlds):
    a, b = worlds.run(2, _loader)
    assert a["len"] == b["len"] == 5
    assert not set(a["seen"]) & set(b["seen"]) and len(set(a["seen"]) | set(b["seen"])) == 40


def _errors(rank, world):
    import zerotrain
    from zerotrain.errors import StateError
    out = {}
    model = R.make_model()
    engine, opt, _, _ = zerotrain.initialize(model=model, config=R.engine_config(stage=1))
    for name, call in (("step_without_backward", engine.step), ("optimizer_step", opt.step)):
        try:
            call()
            out[name] = None
        except StateError as exc:
            out[name] = str(exc)
    try:
        zerotrain.initialize(model=R.make_model(),
                             config={**R.engine_config(stage=1), "zero_optimisation": {}})
    except zerotrain.ConfigError as exc:
        out["misspelt"] = str(exc)
    return out


def test_misuse_is_a_clear_error_on_every_rank(worlds):
    for res in worlds.run(2, _errors):
        assert "without any engine.backward" in res["step_without_backward"]
        assert "without any engine.backward" in res["optimizer_step"]
        assert "zero_optimisation" in res["misspelt"] and "zero_optimization" in res["misspelt"]


def _unused(rank, world):
    """``ignore_unused_parameters: false`` at stages 1 and 2: a parameter that got no
    gradient on one rank stops the step on every rank, naming it where it happened; the
    window is dropped and training goes on; with the key true nothing is checked."""
    import torch
    import zerotrain
    from zerotrain.errors import UnusedParameterError

    class WithSide(R.TinyNet):
        def __init__(self):
            super().__init__()
            self.side = torch.nn.Linear(R.OUT, 1)

        def forward(self, x, y, side=True):
            loss = super().forward(x, y)
            return loss + 0.01 * self.side(y).sum() if side else loss

    out = {}
    for stage in (1, 2):
        for ignore in (False, True):
            torch.manual_seed(0)
            config = R.engine_config(stage=stage, ga=2)
            config["zero_optimization"]["ignore_unused_parameters"] = ignore
            engine, *_ = zerotrain.initialize(model=WithSide(), config=config)
            seen = []
            for step, skip_on in enumerate((None, 1, None, 0)):
                try:
                    for micro in range(2):   # the side branch is skipped in both micro-steps
                        x, y = R.micro_batch(step, rank, micro)
                        engine.backward(engine(x, y, side=rank != skip_on))
                        engine.step()
                    seen.append("stepped")
                except UnusedParameterError as exc:
                    assert isinstance(exc, AssertionError)
                    seen.append(str(exc))
            out[(stage, ignore)] = seen
            engine.close()
    return out


def test_unused_parameters_are_an_error_on_every_rank_when_asked(worlds):
    for rank, res in enumerate(worlds.run(2, _unused)):
        for stage in (1, 2):
            assert res[(stage, True)] == ["stepped"] * 4
            seen = res[(stage, False)]
            assert seen[0] == seen[2] == "stepped", seen
            for skip_on, message in ((1, seen[1]), (0, seen[3])):
                assert "ignore_unused_parameters" in message, message
                if rank == skip_on:
                    assert f"on rank {rank}: 'side.weight', 'side.bias'" in message, message
                else:
                    assert "another rank" in message, message


def _mismatched_model(rank, world):
    import zerotrain
    model = R.make_model()
    if rank == 1:
        model.hidden = torch.nn.Linear(13, 31)
        model.out = torch.nn.Linear(31, R.OUT)
    zerotrain.initialize(model=model, config=R.engine_config(stage=2))


def test_ranks_with_different_models_fail_fast_naming_the_difference():
    results = run_world(_mismatched_model, 2, expect_error=True, timeout=120)
    for res in results:
        assert not res["ok"] and "RankMismatchError" in res["error"], res
        assert "rank 1" in res["error"] and "hidden.weight" in res["error"], res


@pytest.mark.slow
def test_config_from_args_and_single_process_without_launcher(tmp_path):
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(R.engine_config(stage=2)))
    script = f"""
import argparse, sys
sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
import torch, zerotrain, reference as R
parser = zerotrain.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args(["--deepspeed", "--deepspeed_config", {str(config_path)!r}])
zerotrain.init_distributed()
engine, *_ = zerotrain.initialize(args=args, model=R.make_model())
R.train_engine(engine, steps=2, rank=0, ga=1)
print("world", torch.distributed.get_world_size(), "steps", engine.global_steps)
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "world 1 steps 2" in out.stdout


def _engine_counts(rank, world):
    import reference as R
    import zerotrain
    engine, *_ = zerotrain.initialize(model=R.make_model(),
                                      config=R.engine_config(stage=2, ga=2))
    R.train_engine(engine, steps=4, rank=rank, ga=2)
    timer = engine.tput_timer
    return (timer.global_step_count, timer.micro_step_count, timer.batch_size,
            timer.avg_samples_per_sec() > 0)


def test_tput_timer_counts_optimizer_and_micro_steps(worlds):
    assert worlds.run(2, _engine_counts) == [(4, 8, 16, True)] * 2


def _manual_boundary(rank, world, stage):
    """accelerate's loop: the boundary is set before each backward and step() is called only
    at the boundary; it must train exactly like the engine counting micro-steps."""
    import zerotrain
    trained = []
    for manual in (False, True):
        engine, *_ = zerotrain.initialize(model=R.make_model(),
                                          config=R.engine_config(stage=stage, ga=2))
        for step in range(3):
            for micro in range(2):
                if manual:
                    engine.set_gradient_accumulation_boundary(micro == 1)
                engine.backward(engine(*R.micro_batch(step, rank, micro)))
                if not manual or micro == 1:
                    engine.step()
        trained.append(({n: p.detach().clone() for n, p in engine.module.named_parameters()},
                        engine.global_steps))
    (plain, plain_steps), (manual, manual_steps) = trained
    return R.max_diff(plain, manual), plain_steps, manual_steps


@pytest.mark.parametrize("stage", [1, 2])
def test_set_gradient_accumulation_boundary_trains_like_counted_micro_steps(worlds, stage):
    assert worlds.run(2, _manual_boundary, stage) == [(0.0, 3, 3)] * 2


def _client_optimizers_job(rank, world):
    import torch
    import zerotrain
    from zerotrain.errors import ConfigError
    out = {}
    for name in ("Adafactor", "RMSprop"):
        for allow in (False, True):
            model = R.make_model()
            config = R.engine_config(stage=1)
            del config["optimizer"]
            if allow:
                config["zero_allow_untested_optimizer"] = True
            optimizer = getattr(torch.optim, name)(model.parameters(), lr=1e-2)
            try:
                engine, *_ = zerotrain.initialize(model=model, optimizer=optimizer, config=config)
                R.train_engine(engine, steps=1, rank=rank, ga=1)
                out[(name, allow)] = "trained"
            except ConfigError as e:
                out[(name, allow)] = str(e)
    # the optimizer offloaded: DeepSpeed's zero_force_ds_cpu_optimizer (on by default)
    # takes DeepSpeedCPUAdam only, unless it is false
    from zerotrain.ops.adam import DeepSpeedCPUAdam
    for name, force in (("Adam", None), ("Adam", False), ("DeepSpeedCPUAdam", None)):
        model = R.make_model()
        config = R.engine_config(stage=1)
        del config["optimizer"]
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if force is not None:
            config["zero_force_ds_cpu_optimizer"] = force
        cls = DeepSpeedCPUAdam if name == "DeepSpeedCPUAdam" else torch.optim.Adam
        try:
            engine, *_ = zerotrain.initialize(model=model, optimizer=cls(model.parameters()),
                                              config=config)
            R.train_engine(engine, steps=1, rank=rank, ga=1)
            assert engine.zero_force_ds_cpu_optimizer() is (force is None)
            engine.destroy()
            out[("offloaded", name, force)] = "trained"
        except ConfigError as e:
            out[("offloaded", name, force)] = str(e)
    return out


def test_a_client_optimizer_not_known_to_be_elementwise_is_refused_by_name(worlds):
    for out in worlds.run(2, _client_optimizers_job):
        refused = out[("Adafactor", False)]
        assert refused.startswith("optimizer") and "torch.optim.Adafactor" in refused, refused
        assert "zero_allow_untested_optimizer" in refused, refused
        assert out[("Adafactor", True)] == "trained"     # DeepSpeed's key steps it anyway
        assert out[("RMSprop", False)] == out[("RMSprop", True)] == "trained"
        refused = out[("offloaded", "Adam", None)]
        assert refused.startswith("zero_force_ds_cpu_optimizer") and (
            "torch.optim.adam.Adam is not DeepSpeedCPUAdam") in refused, refused
        assert out[("offloaded", "Adam", False)] == "trained"
        assert out[("offloaded", "DeepSpeedCPUAdam", None)] == "trained"


def _deepspeed_accessors_job(rank, world):
    """DeepSpeed's configuration accessors on three engines: a config optimizer with fp16 and
    the optimizer offloaded, a client SGD at stage 3 with two groups, and no optimizer."""
    import zerotrain

    def answers(engine):
        return {"dp": (engine.dp_world_size, engine.get_data_parallel_world_size(),
                       engine.get_data_parallel_rank(), engine.mp_world_size),
                "zero": (engine.zero_optimization(), engine.zero_optimization_stage(),
                         engine.zero_optimization_partition_gradients(),
                         engine.zero_optimization_partition_weights()),
                "offload": (engine.zero_offload_optimizer() is not None and
                            engine.zero_offload_optimizer().device, engine.zero_cpu_offload(),
                            engine.zero_use_cpu_optimizer()),
                "optimizer": (engine.optimizer_name(), engine.get_mom()),
                "precision": (engine.fp16_enabled(), engine.dynamic_loss_scale()),
                "batch": engine.get_batch_info()}

    config = R.engine_config(stage=2, ga=2, precision="fp16", micro_size=3)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    R.train_engine(engine, steps=1, rank=rank, ga=2, micro_size=3)
    out = {"fp16_offload": answers(engine)}
    engine.close()

    model = R.make_model()
    groups = [{"params": [model.hidden.weight], "momentum": 0.7},
              {"params": [p for n, p in model.named_parameters() if n != "hidden.weight"]}]
    sgd = torch.optim.SGD(groups, lr=0.1, momentum=0.5)
    config = R.engine_config(stage=3)
    del config["optimizer"]
    engine, *_ = zerotrain.initialize(model=model, optimizer=sgd, config=config)
    out["client_sgd"] = answers(engine)
    engine.close()

    config = R.engine_config(stage=0, precision="fp16")
    config["fp16"]["loss_scale"] = 128
    del config["optimizer"]
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    out["no_optimizer"] = answers(engine)
    engine.close()
    return out


def test_deepspeed_engine_accessors_answer_as_deepspeeds(worlds):
    for rank, res in enumerate(worlds.run(2, _deepspeed_accessors_job)):
        a, b, c = res["fp16_offload"], res["client_sgd"], res["no_optimizer"]
        for answers in (a, b, c):
            assert answers["dp"] == (2, 2, rank, 1), answers
        assert a["zero"] == (True, 2, True, False), a
        assert b["zero"] == (True, 3, True, True), b
        assert c["zero"] == (False, 0, False, False), c
        assert a["offload"] == ("cpu", True, True), a
        assert b["offload"] == (False, False, False) == c["offload"], b
        assert a["optimizer"] == ("adamw", [(0.9, 0.95)]), a    # config names in lower case
        assert b["optimizer"] == ("SGD", [0.7, 0.5]), b          # per group, the client's
        assert c["optimizer"] == (None, []), c
        assert a["precision"] == (True, True), a                 # loss_scale 0: dynamic
        assert b["precision"] == (False, False), b
        assert c["precision"] == (True, False), c                # a static scale of 128
        assert a["batch"] == (12, 3, 2) and b["batch"] == (8, 4, 1), (a, b)
