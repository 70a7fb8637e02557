"""A DeepSpeed-style training script; moving it from DeepSpeed changed one import.

    python -m torch.distributed.run --nproc_per_node 2 examples/train.py \
        --deepspeed --deepspeed_config examples/ds_config.json

(`examples/ds_config_offload.json`: the same at ZeRO-3 with parameters and optimizer
state offloaded to the CPU.)

It trains the demo's small byte-level GPT on the Python standard library's own source
files, which every machine with Python has.
"""
from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch

import zerotrain as deepspeed  # the only line that differs from a DeepSpeed script
from zerotrain.demo.model import GPT, GPTConfig  # the demo's small GPT


class ByteChunks(torch.utils.data.Dataset):
    """Fixed-length windows of the bytes of some standard-library modules."""

    def __init__(self, block_size: int, files: int = 40) -> None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        paths = sorted(stdlib.glob("*.py"))[:files]
        data = b"".join(p.read_bytes() for p in paths)
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int):
        chunk = self.data[i * self.block_size: (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model,
                                                model_parameters=model.parameters(),
                                                training_data=ByteChunks(cfg.block_size))
    rank = torch.distributed.get_rank()
    batches = deepspeed.RepeatingLoader(loader)
    start = time.perf_counter()
    while engine.global_steps < args.steps:
        idx, targets = next(batches)
        loss = engine(idx.to(engine.device), targets.to(engine.device))
        engine.backward(loss)
        updated = engine.is_gradient_accumulation_boundary()
        engine.step()
        if rank == 0 and updated and engine.global_steps % 10 == 0:
            print(f"step {engine.global_steps:4d}  loss {loss.item():.3f}  "
                  f"lr {engine.get_lr()[0]:.2e}  {time.perf_counter() - start:.1f}s", flush=True)
    if rank == 0:
        mem = engine.memory_breakdown()
        print("per-rank bytes:", {k: f"{v / 2**20:.2f} MiB" for k, v in mem.items()})


if __name__ == "__main__":
    main()
