#!/usr/bin/env python
"""Tensor parallelism under ZeRO against plain ZeRO, on 4 CPU ranks (gloo).

The same Llama-style model (``transformers.LlamaConfig``, random weights) and the same
global batch (8 sequences of 64 tokens) train for ``--steps`` AdamW steps at ZeRO stage
``--stage``, as T=2 x DP=2 (``tensor_parallel.autotp_size`` 2, micro-batch 4) and as DP=4
(micro-batch 2), in the same four processes, one torch thread each.

Printed, one row per mesh (a markdown table): median s/step (wall, max over ranks) and
process CPU s/step over steps 2..N; rank 0's parameters, gradients and optimizer state
(bytes, ``engine.memory_breakdown()``); bytes per step on the data-parallel (and world)
groups and on the tensor-parallel group (``engine.communication_breakdown()``); the loss of
the last step's global batch (the mean over ranks: both meshes see the same 8 sequences, so
it agrees to rounding). Timing on a shared machine is noisy: read the CPU column.

    python bench/tp_cpu.py                    # stage 2, 6 steps, ~1-3 min
    python bench/tp_cpu.py --stage 1 --steps 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, SEQ, GLOBAL = 4, 64, 8


def _model():
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ))


def _run(tp: int, stage: int, steps: int) -> dict:
    import zerotrain
    dp = WORLD // tp
    micro = GLOBAL // dp
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = zerotrain.initialize(model=_model(), config=config)
    rank = engine.get_data_parallel_rank()
    wall, cpu, loss = [], [], 0.0
    engine.communication_breakdown()
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 2048, (GLOBAL, SEQ), generator=g)[rank * micro:(rank + 1) * micro]
        t0, c0 = time.perf_counter(), time.process_time()
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        loss = float(out.loss.detach())
    comm = engine.communication_breakdown()
    memory = engine.memory_breakdown()
    engine.destroy()
    per_step = {k: sum(v.values()) // steps for k, v in comm.items() if isinstance(v, dict)}
    return {"wall": statistics.median(wall[1:]), "cpu": statistics.median(cpu[1:]),
            "memory": memory, "comm": per_step, "loss": loss}


def _worker(rank: int, store: str, stage: int, steps: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank,
                            world_size=WORLD)
    results = {tp: _run(tp, stage, steps) for tp in (2, 1)}
    queue.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "store"), args.stage,
                                                   args.steps, queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        results = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
    mib = 2 ** 20
    print(f"stage {args.stage}, {args.steps} steps, global batch {GLOBAL} x {SEQ} tokens, "
          f"{WORLD} gloo ranks, torch {torch.__version__}\n")
    print("| mesh | s/step (wall) | CPU s/step | params MiB | grads MiB | optimizer MiB | "
          "DP+world MiB/step | TP MiB/step | last loss (global batch) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp in (2, 1):
        rows = [results[r][tp] for r in range(WORLD)]
        mem, comm = rows[0]["memory"], rows[0]["comm"]
        dp_bytes = comm.get("intra_node", 0) + comm.get("cross_node", 0)
        print(f"| T={tp} x DP={WORLD // tp} | {max(r['wall'] for r in rows):.3f} | "
              f"{max(r['cpu'] for r in rows):.3f} | {mem.get('parameters', 0) / mib:.2f} | "
              f"{mem.get('gradients', 0) / mib:.2f} | {mem.get('optimizer_state', 0) / mib:.2f}"
              f" | {dp_bytes / mib:.2f} | {comm.get('tensor_parallel', 0) / mib:.2f} | "
              f"{statistics.mean(r['loss'] for r in rows):.6f} |")


if __name__ == "__main__":
    main()
