"""Per-rank activation peak of one training step at a long sequence, for sequence-parallel
sizes and tiled MLP / tiled loss on and off (DeepSpeed's ALST), on CPU gloo ranks.

Written against DeepSpeed's public names only (``deepspeed.initialize(..., mpu=...)``,
``deepspeed.runtime.sequence_parallel.ulysses_sp``: ``UlyssesSPAttentionHF``,
``UlyssesSPDataLoaderAdapter``, ``TiledMLP``, ``TiledFusedLogitsLoss``), so the same file
measures the real DeepSpeed and zerotrain through the switch::

    PYTHONPATH=/tmp/dsx:src python bench/sequence_memory.py --backend deepspeed
    PYTHONPATH=src python bench/sequence_memory.py --backend zerotrain

What is measured: the live-storage peak (``zerotrain.estimate.peak.PeakTracker``, which
checks the bytes of every live tensor storage after each operation) over the forward and
backward of one micro-batch, counting only storages made during it: activations, their
gradients, the all-to-all buffers and the weights' gradients (the model is tiny, its
gradients about 1 MiB, so the peak is activations). The maximum over the ranks is
reported. A tiny Llama is built from a config (sdpa attention, no hub access). Each SP
size runs in one world of ``sp`` processes, which measures every tiling configuration in
turn on the same engine (one step each, after one step left out: lazy buffers).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

MODEL = dict(vocab_size=4096, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1 << 16)


def _deepspeed(backend: str):
    if backend == "zerotrain":
        import zerotrain.as_deepspeed
        zerotrain.as_deepspeed.install()
    import deepspeed
    return deepspeed


TILES = {"mlp": 1}   # the TiledMLP shards of the configuration being measured (1: untiled)


def _ulysses(world: int):
    """DeepSpeed's ALST module; at SP=1 on a zerotrain without it, the tiled functions
    from ``zerotrain.sequence.tiled`` (SP=1 needs nothing else)."""
    try:
        from deepspeed.runtime.sequence_parallel import ulysses_sp
        return ulysses_sp
    except ModuleNotFoundError:
        if world > 1:
            raise
        from zerotrain.sequence import tiled
        return tiled


def _tile_mlp(ulysses) -> None:
    """LlamaMLP.forward through ``TiledMLP`` (DeepSpeed's documented patch) when
    ``TILES["mlp"] > 1``, the plain MLP otherwise."""
    from transformers.models.llama import modeling_llama

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_forward(self, x):
        n = min(TILES["mlp"], x.shape[-2])
        if n <= 1:
            return mlp_forward(self, x)
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return ulysses.TiledMLP.apply(mlp_forward, self, x, n, params)

    modeling_llama.LlamaMLP.forward = tiled_forward


def _loss_sum(model, ulysses, hidden, shift_labels, loss_shards: int) -> torch.Tensor:
    """The summed cross-entropy of this rank's tokens, tiled or not."""
    vocab = model.config.vocab_size

    def loss_fn(self, x, y):
        logits = self.lm_head(x).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, vocab), y.view(-1),
                                                 reduction="sum", ignore_index=-100)

    if loss_shards > 1:
        return ulysses.TiledFusedLogitsLoss.apply(
            loss_fn, model, hidden, shift_labels, None, loss_shards, [model.lm_head.weight], "sum")
    return loss_fn(model, hidden, shift_labels)


def _rank(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    deepspeed = _deepspeed(args.backend)
    ulysses = _ulysses(world)
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotrain.estimate.peak import PeakTracker
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    _tile_mlp(ulysses)
    config = LlamaConfig(**MODEL, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    mpu = None   # what register_with_transformers returns at SP=1
    if world > 1:
        mpu = ulysses.UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa",
            sequence_parallel_size=world, micro_batch_size=1, seq_length=args.seq,
            seq_length_is_variable=True)
    # small buckets: the gradient reduction buffers stay far below the activations
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 100000,
                                       "allgather_bucket_size": 100000},
                 "steps_per_print": 10 ** 9}
    if world > 1:
        ds_config["sequence_parallel_size"] = world
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                      mpu=mpu)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (world, args.seq), generator=g)
    samples = [dict(input_ids=ids[i:i + 1], position_ids=torch.arange(args.seq)[None],
                    labels=ids[i:i + 1].clone()) for i in range(world)]
    if world > 1:
        group = mpu.get_sequence_parallel_group()
        batches = ulysses.UlyssesSPDataLoaderAdapter(
            samples, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
            sp_world_size=world, device=torch.device("cpu"))
        batch = next(iter(batches))
    else:
        batch = dict(samples[0])
        labels = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=-100)
        batch["shift_labels"] = labels[..., 1:].contiguous()
    shift_labels = batch.pop("shift_labels")
    count = torch.tensor(float((shift_labels != -100).sum()))
    if world > 1:
        deepspeed.comm.all_reduce(count, group=mpu.get_sequence_parallel_group())
    results = []
    # the first configuration twice: its first step (lazy buffers) is left out
    for mlp_shards, loss_shards in [args.modes[0]] + args.modes:
        TILES["mlp"] = mlp_shards
        tracker = PeakTracker()
        with tracker:
            hidden = engine.module.model(**batch).last_hidden_state
            loss = _loss_sum(engine.module, ulysses, hidden, shift_labels, loss_shards) / count
            engine.backward(loss)
        del hidden
        engine.step()
        results.append({"peak": tracker.peak, "loss": loss.item()})
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(results[1:], f)


def measure(args: argparse.Namespace, sp: int) -> list[dict]:
    """One world of ``sp`` ranks runs every configuration of ``args.modes`` in turn."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(sp, args, out), nprocs=sp, join=True,
                           start_method="spawn")
        ranks = [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(sp)]
    return [{"peak_mib": max(r[k]["peak"] for r in ranks) / 2 ** 20,
             "loss": sum(r[k]["loss"] for r in ranks)} for k in range(len(args.modes))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["deepspeed", "zerotrain"], required=True)
    p.add_argument("--seq", type=int, default=8192, help="global sequence length")
    p.add_argument("--sp", default="1,2,4", help="sequence-parallel sizes (comma-separated)")
    p.add_argument("--tiled", default="off,mlp,loss,both",
                   help="which of off, mlp, loss, both to run")
    p.add_argument("--mlp-shards", type=int, default=0,
                   help="TiledMLP shards (default: ceil(seq / sp / hidden), DeepSpeed's rule)")
    p.add_argument("--loss-shards", type=int, default=8)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--json", help="write the rows here as well")
    args = p.parse_args(argv)
    rows = []
    modes = args.tiled.split(",")
    for n, sp in enumerate(int(s) for s in args.sp.split(",")):
        run = argparse.Namespace(**vars(args))
        run.port = args.port + n
        auto = math.ceil(args.seq / sp / MODEL["hidden_size"])
        run.modes = [((args.mlp_shards or auto) if mode in ("mlp", "both") else 1,
                      args.loss_shards if mode in ("loss", "both") else 1) for mode in modes]
        for mode, (mlp, loss), got in zip(modes, run.modes, measure(run, sp)):
            row = {"backend": args.backend, "seq": args.seq, "sp": sp, "tiled": mode,
                   "mlp_shards": mlp, "loss_shards": loss, **got}
            rows.append(row)
            print(f"{row['backend']:9s} seq={row['seq']} sp={sp} tiled={mode:4s} "
                  f"peak={row['peak_mib']:8.1f} MiB loss={row['loss']:.5f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
