"""What the delayed parameter update (``offload_optimizer.dpu``) does to convergence.

    python bench/dpu_convergence.py                # 400 steps, demo GPT, CPU, ~1 minute
    python bench/dpu_convergence.py --steps 100    # quicker

Trains the demo's byte-level GPT on the standard library's source twice in one process,
ZeRO-2 with the optimizer offloaded to the CPU, with and without ``dpu`` (same seed, same
batches, same LR schedule), and prints the training loss (mean over windows of steps) and
the validation loss at the end, side by side. With ``dpu`` each step's gradient is taken
at the parameters of two updates before (the update of the step before is still running),
so early training, where the parameters move fastest, lags a little.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

import zerotrain
from zerotrain.demo.data import load_corpus
from zerotrain.demo.model import GPT, GPTConfig

MODEL = GPTConfig(n_layer=4, n_head=4, d_model=128, block_size=128)


def run(delayed: bool, steps: int, corpus, micro: int, lr: float) -> dict:
    torch.manual_seed(0)
    model = GPT(MODEL)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": steps, "warmup_num_steps": max(1, steps // 20)}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                "dpu": delayed}},
        "steps_per_print": 10 ** 9,
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = corpus.train_batch(micro, MODEL.block_size, generator)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()   # lands the pending delayed update
    with torch.no_grad():
        x, y = corpus.val_batch(64, MODEL.block_size, rank=0, world=1)
        val = engine(x, y).item()
    engine.close()
    return {"losses": losses, "val": val}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--windows", type=int, default=8, help="rows of the loss table")
    args = parser.parse_args(argv)
    logging.getLogger("zerotrain").setLevel(logging.WARNING)
    print("command: python " + " ".join(sys.argv))
    corpus = load_corpus(max_bytes=4_000_000)
    plain = run(False, args.steps, corpus, args.micro_batch, args.lr)
    delayed = run(True, args.steps, corpus, args.micro_batch, args.lr)
    width = max(1, args.steps // args.windows)
    print("\n| steps | train loss, no dpu | train loss, dpu | difference |")
    print("|---|---|---|---|")
    for start in range(0, args.steps, width):
        a = plain["losses"][start: start + width]
        b = delayed["losses"][start: start + width]
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        print(f"| {start + 1}-{start + len(a)} | {ma:.4f} | {mb:.4f} | {mb - ma:+.4f} |")
    print(f"| validation at the end | {plain['val']:.4f} | {delayed['val']:.4f} | "
          f"{delayed['val'] - plain['val']:+.4f} |")
    print(json.dumps({"val_plain": plain["val"], "val_dpu": delayed["val"]}))


if __name__ == "__main__":
    main()
