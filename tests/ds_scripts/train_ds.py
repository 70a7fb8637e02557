"""A training script written for DeepSpeed, in the style of DeepSpeedExamples: its own
argparse with --local_rank, DeepSpeed's imports, a user-built FusedAdam, and checkpoints
with an integer tag and a client_state holding a tensor. It trains once per --stage given
(a small sweep). The tests run it unmodified through `zerotrain launch --as-deepspeed`."""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import log_dist, safe_get_full_fp32_param

from toy import batch, build_model


def add_argument():
    parser = argparse.ArgumentParser(description="toy")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--stage", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--save_dir", type=str, required=True)
    parser.add_argument("--out", type=str, required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main(args):
    deepspeed.init_distributed()
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", 0)))
    results = {str(stage): train(args, stage) for stage in args.stage}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


def train(args, stage):
    save_dir = os.path.join(args.save_dir, f"stage{stage}")
    net = build_model()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe:
        parameters = split_params_into_different_moe_groups_for_optimizer(parameters)
    optimizer = FusedAdam(parameters, lr=1e-2, weight_decay=0.01)
    ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=net, optimizer=optimizer,
                                                   config=ds_config)
    device = get_accelerator().device_name(engine.local_rank)
    rank = dist.get_rank()
    criterion = nn.CrossEntropyLoss()
    for step in range(args.steps):
        x, y = batch(step, rank)
        loss = criterion(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        log_dist(f"step {step} loss {loss.item():.4f}", ranks=[0])
        if step == 1:
            engine.save_checkpoint(save_dir, tag=step + 1, client_state={
                "step": step + 1, "marker": torch.arange(5.0), "args": args,
                "python_rng": random.getstate(), "numpy_rng": np.random.get_state(),
                "torch_rng": torch.get_rng_state()})
    assert engine.steps_per_print() == 1000 and not engine.wall_clock_breakdown()
    weights = {name: safe_get_full_fp32_param(p).tolist() for name, p in net.named_parameters()}
    statuses = sorted({str(getattr(p, "ds_status", None)) for p in net.parameters()})
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    dist.barrier()
    _, client_state = engine.load_checkpoint(save_dir, tag=2)
    engine.destroy()
    random.setstate(client_state["python_rng"])
    np.random.set_state(client_state["numpy_rng"])
    torch.set_rng_state(client_state["torch_rng"])
    return {"weights": weights, "world": dist.get_world_size(),
            "all_reduce": total.item(), "statuses": statuses,
            "accelerator": get_accelerator().device_name(),
            "local_rank_arg": args.local_rank,
            "client_step": client_state["step"],
            "client_marker": client_state["marker"].tolist(),
            "client_args_stages": client_state["args"].stage,
            "resumed_step": engine.global_steps,
            "zero_param_status": ZeroParamStatus.NOT_AVAILABLE.name}


if __name__ == "__main__":
    main(add_argument())
