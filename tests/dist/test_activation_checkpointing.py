"""Activation checkpointing trains exactly like the same model without it, at every stage.

The model's blocks call ``zerotrain.checkpointing.checkpoint(block, x)`` (or torch's own
checkpoint, whose recomputation stops early), with dropout in every block. The
recomputation replays the forward's RNG state and the same operations on the same values,
so the parameters after several steps are bitwise those of the run without checkpointing.
At stage 3 the recomputation gathers parameters again through the module hooks; the cases
cover prefetching (``overlap_comm``), everything partitioned (persistence threshold 0),
units kept for reuse, and check that each unit is released once its gradients are in.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import reference as R

STEPS = 4
WIDTH = 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, scale=1.0):
        # b is the last operation that saves tensors: torch's early stop raises inside it
        return x + self.b(self.drop(F.gelu(self.a(x)))) * scale


class Net(nn.Module):
    """``mode``: "off", "zerotrain" (DeepSpeed's API) or "torch" (torch's checkpoint)."""

    def __init__(self, mode: str, depth: int = 3) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(R.IN, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.out = nn.Linear(WIDTH, R.OUT)

    def forward(self, x, y):
        import zerotrain
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if self.mode == "zerotrain":  # a non-tensor argument on odd blocks
                h = (zerotrain.checkpointing.checkpoint(block, h, 0.5) if i % 2
                     else zerotrain.checkpointing.checkpoint(block, h))
            elif self.mode == "torch":
                h = torch.utils.checkpoint.checkpoint(block, h, 0.5 if i % 2 else 1.0,
                                                      use_reentrant=False)
            else:
                h = block(h, 0.5) if i % 2 else block(h)
        return F.mse_loss(self.out(h), y)


@contextlib.contextmanager
def _restored_checkpointing():
    """The pool's ranks live on between tests: leave checkpointing as it was found."""
    from zerotrain import recompute
    saved = recompute._settings, recompute._configured
    try:
        yield
    finally:
        recompute._settings, recompute._configured = saved


def _watch_releases(engine) -> list:
    """Names of units still gathered when backward moved on to another unit after their
    last gradient arrived (stage 3): a unit is released as soon as its backward is done."""
    scheduler = engine.stage.scheduler
    needed = {u.spec.index: sum(p.requires_grad for p in u.spec.params)
              for u in scheduler.units}
    arrived: dict = {}
    done: set = set()
    late: list = []
    gradient_arrived, before_backward = scheduler.gradient_arrived, scheduler.before_backward

    def on_gradient(index):
        gradient_arrived(index)
        arrived[index] = arrived.get(index, 0) + 1
        if arrived[index] == needed[index]:
            arrived[index] = 0
            done.add(index)

    def on_backward(index, *module):
        for i in sorted(done - {index}):
            unit = scheduler.units[i]
            if unit.full.untyped_storage().nbytes() and not unit.spec.deps:
                late.append(unit.spec.name or "<root>")
        done.clear()
        before_backward(index, *module)

    def on_end(end_backward=scheduler.end_backward):
        done.clear()
        end_backward()

    scheduler.gradient_arrived, scheduler.before_backward = on_gradient, on_backward
    scheduler.end_backward = on_end
    return late


def _watch_usage(model) -> dict:
    """DeepSpeed's usage records as the blocks see them (stage 3, Note "usage records" in
    zero3/usage.py): each linear in its own forward and each weight's gradient find a module
    of theirs using their unit; a recomputation's kept parameters are the block's."""
    seen = {"forward": [], "backward": [], "recompute": [], "after": []}
    for block in model.blocks:
        ids = {m.ds_id for m in block.modules()}
        for linear in (block.a, block.b):
            linear.register_forward_pre_hook(
                lambda m, a: seen["forward"].append(m.ds_id in m.weight.ds_active_sub_modules))
            linear.weight.register_hook(lambda g, w=linear.weight, ids=ids: seen[
                "backward"].append(bool(w.ds_active_sub_modules) and w.ds_active_sub_modules <= ids))

        def recomputed(m, args, out):
            if torch._C._current_graph_task_id() != -1:
                kept = {p.ds_id for sub in m.modules() for p in sub.ds_recompute_parameters}
                seen["recompute"].append(sorted(kept) if kept <= {
                    p.ds_id for p in m.parameters()} else "not the block's")
        block.register_forward_hook(recomputed)
    return seen


def _usage_clean(model) -> bool:
    return (not any(p.ds_active_sub_modules for p in model.parameters())
            and not any(m.ds_recompute_parameters for m in model.modules()))


def _train(rank, mode, config):
    import zerotrain
    torch.manual_seed(0)
    model = Net(mode)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    stage3 = config["zero_optimization"]["stage"] == 3
    late = _watch_releases(engine) if stage3 else []
    usage = _watch_usage(model) if stage3 else None
    losses = []
    for step in range(STEPS):
        for micro in range(config.get("gradient_accumulation_steps", 1)):
            torch.manual_seed(1000 * step + 10 * rank + micro)  # dropout masks per rank/step
            loss = engine(*R.micro_batch(step, rank, micro))
            engine.backward(loss)
            if usage is not None:
                usage["after"].append(_usage_clean(model))
            engine.step()
            losses.append(loss.item())
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "late": late, "usage": usage}


def _grid(rank, world, cases):
    from zerotrain import checkpointing
    out = []
    for name, mode, config in cases:
        with _restored_checkpointing():
            plain = _train(rank, "off", config)
            checkpointed = _train(rank, mode, config)
            settings = checkpointing.current_settings().model_dump()
        out.append({"case": name, "diff": R.max_diff(plain["params"], checkpointed["params"]),
                    "same_losses": plain["losses"] == checkpointed["losses"],
                    "late": checkpointed["late"], "plain_late": plain["late"],
                    "settings": settings, "usage": checkpointed["usage"],
                    "reuse": config["zero_optimization"].get("stage3_max_reuse_distance")})
    return out


def _config(stage, *, overlap=False, ga=1, **zero):
    config = R.engine_config(stage=stage, ga=ga, overlap=overlap)
    config["zero_optimization"].update(zero)
    return config


def _cases(world):
    cases = [
        ("stage 3, overlap (prefetch), persistence 0", "zerotrain",
         _config(3, overlap=True, stage3_param_persistence_threshold=0,
                 stage3_max_reuse_distance=0)),
        ("stage 3, overlap, units kept for reuse", "zerotrain",
         _config(3, overlap=True, stage3_param_persistence_threshold=0,
                 stage3_max_reuse_distance=400)),
    ]
    if world == 2:
        cases += [
            ("stage 0", "zerotrain", _config(0)),
            ("stage 2, accumulation 2", "zerotrain", _config(2, ga=2, overlap=True)),
            ("stage 3, no prefetch, persistence 0", "zerotrain",
             _config(3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)),
            ("stage 3, small parameters persistent", "zerotrain",
             _config(3, overlap=True, stage3_param_persistence_threshold=20)),
            ("stage 3, cpu_checkpointing from the config", "zerotrain",
             {**_config(3, overlap=True, stage3_param_persistence_threshold=0,
                        stage3_max_reuse_distance=10 ** 9),
              "activation_checkpointing": {"cpu_checkpointing": True, "profile": True,
                                           "synchronize_checkpoint_boundary": True}}),
            ("stage 3, torch's checkpoint (early stop)", "torch",
             _config(3, overlap=True, stage3_param_persistence_threshold=0,
                     stage3_max_reuse_distance=0)),
        ]
    return cases


@pytest.mark.parametrize("world", [2, 3])
def test_checkpointed_blocks_train_like_plain_blocks(worlds, world):
    per_rank = worlds.run(world, _grid, _cases(world))
    for rank, results in enumerate(per_rank):
        for res in results:
            where = f"rank {rank}, {res['case']}"
            # same operations on the same values, dropout replayed: bitwise equal
            assert res["diff"] == 0.0 and res["same_losses"], (where, res["diff"])
            assert res["late"] == [] and res["plain_late"] == [], (where, res)
            if "cpu_checkpointing" in res["case"]:
                assert res["settings"]["cpu_checkpointing"], (where, res["settings"])
            else:
                assert not res["settings"]["cpu_checkpointing"], (where, res["settings"])
            usage = res["usage"]
            if usage is None:
                continue
            for phase in ("forward", "backward", "after"):
                assert usage[phase] and all(usage[phase]), (where, phase, usage[phase])
            # a recomputation keeps its unit for the backward right after it only when
            # units may be kept (stage3_max_reuse_distance, DeepSpeed's default when None):
            # then the block's parameters
            kept = [k for k in usage["recompute"] if k]
            assert "not the block's" not in kept, (where, usage["recompute"])
            assert bool(kept) == (res["reuse"] != 0), (where, res["reuse"], usage["recompute"])


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(R.IN, WIDTH)
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, R.OUT)

    def forward(self, x, y):
        h = self.shared(torch.tanh(self.shared(self.inp(x))))
        return F.mse_loss(self.out(h), y)


def _called_twice(rank, world):
    import zerotrain
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=CalledTwice(), config=_config(
        3, overlap=True, stage3_param_persistence_threshold=0))  # reuse distance: default
    late = _watch_releases(engine)
    for step in range(STEPS):
        engine.backward(engine(*R.micro_batch(step, rank, 0)))
        engine.step()
    return late


def test_a_unit_kept_after_forward_and_used_again_is_released_after_its_gradients(worlds):
    # the same hand-over of a kept unit that a checkpointed block's recomputation needs
    assert worlds.run(2, _called_twice) == [[], []]


class Returned:
    """A plain object holding a module's outputs."""

    def __init__(self, out, bias) -> None:
        self.out, self.bias = out, bias


class BiasOut(nn.Linear):
    """Returns its bias beside its output, for the caller to use (DeepSpeed's external
    parameters): as a view in a tuple or whole in a plain object. At stage 3 the caller
    must find it gathered, in forward and in backward."""

    def __init__(self, width: int, view: bool) -> None:
        super().__init__(width, width)
        self.view = view

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        return (out, self.bias[None]) if self.view else Returned(out, self.bias)


class ScaleOut(nn.Module):
    """An elementwise scale that returns its shift for the caller to add."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, WIDTH))

    def forward(self, x):
        return x * self.weight, self.bias


class AddsShift(nn.Module):
    """A block (its own unit) that uses the shift its ``ScaleOut`` returns: the use is
    inside the unit's forward, which holds the unit already (nothing to pin)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = ScaleOut()

    def forward(self, h):
        v, b = self.scale(h)
        return torch.tanh(v * b + b)


class ReturnsBias(nn.Module):
    """Two ``BiasOut`` whose returned biases (one frozen, one trained) are used by this
    module's forward, inside the checkpointed region for ``mode`` "torch" and
    "zerotrain", and saved for backward (``v * b``); then a block that uses a returned
    shift inside its own unit."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(R.IN, WIDTH)
        self.frozen, self.trained = BiasOut(WIDTH, False), BiasOut(WIDTH, True)
        self.frozen.bias.requires_grad_(False)
        self.blocks = nn.ModuleList([AddsShift()])
        self.out = nn.Linear(WIDTH, R.OUT)

    def _inner(self, h):
        r = self.frozen(h)
        h = torch.tanh(r.out * r.bias + r.bias)
        v, b = self.trained(h)
        return self.blocks[0](torch.tanh(v * b + b))

    def forward(self, x, y):
        import zerotrain
        h = self.inp(x)
        if self.mode == "zerotrain":
            h = zerotrain.checkpointing.checkpoint(self._inner, h)
        elif self.mode == "torch":
            h = torch.utils.checkpoint.checkpoint(self._inner, h, use_reentrant=False)
        else:
            h = self._inner(h)
        return F.mse_loss(self.out(h), y)


def _returned_bias(rank, world):
    import zerotrain
    out = {}
    for stage, mode in [(0, "off"), (3, "off"), (3, "torch"), (3, "zerotrain")]:
        with _restored_checkpointing():
            torch.manual_seed(0)
            model = ReturnsBias(mode)
            engine, *_ = zerotrain.initialize(
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                config=_config(stage, stage3_param_persistence_threshold=0,
                               stage3_max_reuse_distance=0))
            losses = []
            for step in range(2):   # the second follows the first pass's trace
                loss = engine(*R.micro_batch(step, rank, 0))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            held = []   # after backward; after 1, 2 forwards without grad: (unit, holders)
            for _ in range(3 if stage == 3 else 0):
                held.append(sorted((u.spec.name, u._holders) for u in engine.stage.scheduler.units
                                   if not u.spec.persistent and u.full.untyped_storage().nbytes()))
                with torch.no_grad():
                    engine(*R.micro_batch(0, rank, 0))
            with zerotrain.zero.GatheredParameters(list(model.parameters())):
                params = {n: p.detach().clone() for n, p in model.named_parameters()}
            # DeepSpeed's registry: each returned parameter with the caller that used it
            names = {id(p): n for n, p in model.named_parameters()}
            external = {n or "<root>": sorted(names[k] for k in getattr(m, "_external_params", {}))
                        for n, m in model.named_modules() if getattr(m, "_external_params", None)}
            flagged = sorted(n for n, p in model.named_parameters()
                             if getattr(p, "is_external_param", False))
        out[(stage, mode)] = {"losses": losses, "params": params, "held": held,
                              "external": external, "flagged": flagged}
    return out


def test_a_parameter_a_module_returns_trains_like_stage_0(worlds):
    # the caller of a module that returns its bias uses it after the module's forward (its
    # unit's release) and in backward, checkpointed or not
    for rank, runs in enumerate(worlds.run(2, _returned_bias)):
        plain = runs[(0, "off")]
        for case, res in runs.items():
            assert R.max_diff(plain["params"], res["params"]) < 1e-6, (rank, case)
            assert res["losses"] == pytest.approx(plain["losses"], rel=1e-6), (rank, case)
            # released when backward ends; a forward without grad keeps them to the next pass
            pinned = [("frozen", 1), ("trained", 1)]
            assert res["held"] == ([] if case[0] == 0 else [[], pinned, pinned]), (rank, case)
            if case[0] == 3:
                assert res["external"] == {
                    "<root>": ["frozen.bias", "trained.bias"],
                    "blocks.0": ["blocks.0.scale.bias"]}, (rank, case, res["external"])
                assert res["flagged"] == ["blocks.0.scale.bias", "frozen.bias",
                                          "trained.bias"], (rank, case)
