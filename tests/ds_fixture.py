"""The DeepSpeed fixture checkpoints (tests/fixtures/make_deepspeed_ckpts.py) as the
distributed tests use them: a case's config, an engine built for it, the first training
step, and a snapshot of everything a checkpoint load writes (to check that a refused load
changed nothing, or that two loads gave the same state). Imported in the ranks too."""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
import make_deepspeed_ckpts as M  # noqa: E402

FIXTURES = M.DEFAULT_OUT
CASE = "z2_fp32_w2"
TAG = f"global_step{M.BEFORE}"
SAVE_DIR = os.path.join(FIXTURES, CASE, "checkpoint")
OPTIMS = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
MODEL = "mp_rank_00_model_states.pt"


def case_config(case: str = CASE) -> dict:
    with open(os.path.join(FIXTURES, case, "case.json"), encoding="utf-8") as f:
        return json.load(f)["config"]


def build(case: str = CASE, **extra):
    """A zerotrain engine for ``case``'s model (other weights than the fixture's: a load
    must replace them), its config updated with ``extra``."""
    import zerotrain
    model = M.make_model(seed=1)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=M.param_groups(model),
                                      config=dict(case_config(case), **extra))
    return engine


def first_step(engine, rank: int, world: int) -> None:
    """One step, so that the engine holds Adam state a load would overwrite."""
    x, y = M.micro_batch(0, rank, 0, world=world, gas=1,
                         size=engine.train_micro_batch_size_per_gpu())
    engine.backward(engine(x, y))
    engine.step()


def snapshot(engine) -> dict[str, torch.Tensor]:
    """Everything a load writes, as tensors: parameters, fp32 masters, optimizer state,
    counters, group hyperparameters, learning rate, loss scale, data-loader position."""
    state = {f"param.{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    for g, group in enumerate(engine.optimizer.param_groups):
        for i, master in enumerate(group["params"]):
            state[f"master.{g}.{i}"] = master.detach().clone()
        state[f"group.{g}"] = torch.tensor([float(v) for k, v in sorted(group.items())
                                            if isinstance(v, (int, float))])
    for i, values in enumerate(engine.optimizer.state.values()):
        for key, value in values.items():
            state[f"optim.{i}.{key}"] = torch.as_tensor(value).detach().clone()
    state["counters"] = torch.tensor([engine.global_steps, engine.global_samples,
                                      engine.skipped_steps])
    state["lr"] = torch.tensor(engine.get_lr())
    state["scale"] = torch.tensor(float(engine.loss_scale))
    if engine.training_dataloader is not None:
        state["data"] = torch.tensor([v for _, v in sorted(
            engine.training_dataloader.state_dict().items())])
    return state


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
