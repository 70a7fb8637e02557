"""Bytes across nodes and convergence of ZeRO++ / MiCS on a simulated 2-node world.

    python bench/multinode.py bytes                  # byte table, demo GPT, 2 steps (~1 min)
    python bench/multinode.py convergence            # 300 steps plain vs ZeRO++ (~10 min)
    python bench/multinode.py convergence --steps 50

Four gloo processes on this machine, told they are 2 nodes of 2 (``LOCAL_WORLD_SIZE=2`` and
``GROUP_RANK``, as torchrun sets them), train the demo's byte-level GPT at stage 3.
Every unit is gathered again for backward (``stage3_max_reuse_distance`` 0, no persistent
parameters), as for a model too large to keep gathered from forward to backward.
``bytes`` trains 2 steps per setting (bf16 parameters and gradients) and prints rank 0's
``engine.communication_breakdown()`` per step, with the extra memory hpZ keeps.
``convergence`` trains plain stage 3 and qwZ + hpZ + qgZ from the same seed on the same
batches and prints the training loss by window and the validation loss at the end.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, PER_NODE = 4, 2
SETTINGS = {
    "plain stage 3": {},
    "hpZ (zero_hpz_partition_size 2)": {"zero_hpz_partition_size": 2},
    "MiCS (mics_shard_size 2)": {"mics_shard_size": 2},
    "qwZ (zero_quantized_weights)": {"zero_quantized_weights": True},
    "qgZ (zero_quantized_gradients)": {"zero_quantized_gradients": True},
    "qwZ + hpZ": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2},
    "qwZ + hpZ + qgZ (ZeRO++)": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                 "zero_quantized_gradients": True},
}


def _config(zero: dict, *, precision: str, steps: int, micro: int, lr: float) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": steps, "warmup_num_steps": max(1, steps // 20)}},
        # every unit re-gathered for backward, nothing kept whole: a model too big to keep
        # gathered between forward and backward, the regime ZeRO++ is for
        "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0,
                              "stage3_param_persistence_threshold": 0, **zero},
        "steps_per_print": 10 ** 9,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True, "auto_cast": True}
        config["data_types"] = {"grad_accum_dtype": "bf16"}
    return config


def _train(zero: dict, *, rank: int, steps: int, precision: str, micro: int, lr: float,
           corpus) -> dict:
    import zerotrain
    from zerotrain.demo.model import GPT, GPTConfig
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=128, block_size=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    engine, *_ = zerotrain.initialize(model=model, config=_config(
        zero, precision=precision, steps=steps, micro=micro, lr=lr))
    engine.communication_breakdown()
    generator = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(steps):
        x, y = corpus.train_batch(micro, cfg.block_size, generator)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    comm = engine.communication_breakdown()
    memory = engine.memory_breakdown()
    engine.eval()
    with torch.no_grad():
        x, y = corpus.val_batch(64, cfg.block_size, rank=rank, world=WORLD)
        val = engine(x, y).item()
    psi = sum(p.ds_numel for p in model.parameters())
    engine.close()
    return {"losses": losses, "val": val, "comm": comm, "memory": memory, "psi": psi}


def _rank(rank: int, store: str, mode: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % PER_NODE),
                      LOCAL_WORLD_SIZE=str(PER_NODE), GROUP_RANK=str(rank // PER_NODE))
    torch.set_num_threads(1)
    logging.getLogger("zerotrain").setLevel(logging.WARNING)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank,
                            world_size=WORLD)
    from zerotrain.demo.data import load_corpus
    corpus = load_corpus(max_bytes=4_000_000)
    if mode == "bytes":
        names = SETTINGS
        kw = dict(steps=2, precision="bf16", micro=4, lr=args.lr)
    else:
        names = {k: SETTINGS[k] for k in ("plain stage 3", "qwZ + hpZ + qgZ (ZeRO++)")}
        kw = dict(steps=args.steps, precision="fp32", micro=args.micro_batch, lr=args.lr)
    results = {name: _train(zero, rank=rank, corpus=corpus, **kw)
               for name, zero in names.items()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _bytes_table(results: list[dict]) -> None:
    rank0 = results[0]
    psi = rank0["plain stage 3"]["psi"]
    plain = sum(rank0["plain stage 3"]["comm"]["cross_node"].values())
    print(f"\nΨ = {psi:,} parameters; bytes per rank per step (rank 0; 2 steps, bf16 "
          "parameters and gradients)\n")
    print("| setting | cross-node bytes | vs plain | intra-node bytes | "
          "hpZ copy (bytes/rank) |")
    print("|---|---|---|---|---|")
    for name, res in rank0.items():
        steps = res["comm"]["steps"]
        cross = sum(res["comm"]["cross_node"].values()) / steps
        intra = sum(res["comm"]["intra_node"].values()) / steps
        extra = res["memory"].get("hpz_parameters", 0)
        print(f"| {name} | {cross:,.0f} ({cross / psi:.2f} B/Ψ) | {cross * steps / plain:.3f} "
              f"| {intra:,.0f} | {extra:,} |")


def _convergence_table(results: list[dict], windows: int) -> None:
    names = list(results[0])
    steps = len(results[0][names[0]]["losses"])
    width = max(1, steps // windows)
    print(f"\n| steps | {' | '.join(names)} | difference |")
    print("|---|---|---|---|")
    for start in range(0, steps, width):
        means = []
        for name in names:
            window = [sum(r[name]["losses"][i] for r in results) / WORLD
                      for i in range(start, min(steps, start + width))]
            means.append(sum(window) / len(window))
        print(f"| {start + 1}-{min(steps, start + width)} | {means[0]:.4f} | {means[1]:.4f} "
              f"| {means[1] - means[0]:+.4f} |")
    vals = [sum(r[name]["val"] for r in results) / WORLD for name in names]
    print(f"| validation at the end | {vals[0]:.4f} | {vals[1]:.4f} | "
          f"{(vals[1] - vals[0]) / vals[0] * 100:+.2f}% |")
    print(json.dumps({"val_plain": vals[0], "val_zeropp": vals[1]}))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["bytes", "convergence"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--windows", type=int, default=6, help="rows of the loss table")
    args = parser.parse_args(argv)
    print("command: python " + " ".join(sys.argv))
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(os.path.join(tmp, "store"), args.mode, args, tmp),
                           nprocs=WORLD, start_method="spawn")
        results = []
        for rank in range(WORLD):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    if args.mode == "bytes":
        _bytes_table(results)
    else:
        _convergence_table(results, args.windows)


if __name__ == "__main__":
    main()
