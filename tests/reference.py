"""A tiny model, deterministic data and single-process references to compare engines with.

Two references, as explained in ANCHORS-style parity notes:

* ``reference_accumulate`` runs each rank's micro-batches separately, sums each rank's
  gradients, then sums the ranks in rank order and divides by the world size: the same
  arithmetic as data parallelism, so an exact engine matches it bit for bit at world size 2.
* ``reference_global`` runs one forward/backward over the whole global batch: what a user
  means by "the same as single-process training"; rounding differs, so it is compared with
  a looser tolerance.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IN, OUT = 7, 3


class TinyNet(nn.Module):
    """Odd sizes on purpose: every world size from 2 to 4 splits some parameter unevenly."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, 13)
        self.norm = nn.LayerNorm(13)
        self.hidden = nn.Linear(13, 29)
        self.out = nn.Linear(29, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        h = F.gelu(self.hidden(h))
        return F.mse_loss(self.out(h).float(), y.float())


class LoraLinear(nn.Module):
    """A linear layer with a trainable low-rank adapter beside it (LoRA): ``base`` is meant
    to be frozen by the test, ``lora_a`` and ``lora_b`` train."""

    def __init__(self, n_in: int, n_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.lora_a = nn.Parameter(torch.randn(rank, n_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(n_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def micro_batch(step: int, rank: int, micro: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch ``micro`` of ``rank`` at optimizer step ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    x = torch.randn(size, IN, generator=g)
    y = torch.randn(size, OUT, generator=g)
    return x, y


def adamw(params, lr: float = 1e-2, weight_decay: float = 0.01) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=weight_decay)


def summed_gradients(model: TinyNet, step: int, world: int) -> list[torch.Tensor]:
    """Each rank's micro-batch 0 of ``step`` run in turn, gradients summed in rank order
    (bitwise what the ranks' reduction adds up), one tensor per parameter."""
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for rank in range(world):
        model.zero_grad(set_to_none=True)
        model(*micro_batch(step, rank, 0)).backward()
        for g, p in zip(grads, model.parameters()):
            g.add_(p.grad)
    return grads


def reference_accumulate(*, steps: int, world: int, ga: int, clip: float = 0.0,
                         lr: float = 1e-2, micro_size: int = 4) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = adamw(model.parameters(), lr=lr)
    params = list(model.parameters())
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            acc = [torch.zeros_like(p) for p in params]
            for micro in range(ga):
                model.zero_grad(set_to_none=True)
                loss = model(*micro_batch(step, rank, micro, micro_size))
                (loss / ga if ga > 1 else loss).backward()
                for a, p in zip(acc, params):
                    a.add_(p.grad)
            for t, a in zip(total, acc):
                t.add_(a)
        for p, t in zip(params, total):
            p.grad = t.div_(world) if world > 1 else t
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_global(*, steps: int, world: int, ga: int, clip: float = 0.0,
                     lr: float = 1e-2, micro_size: int = 4) -> dict[str, torch.Tensor]:
    """One process; each accumulation step sees all ranks' micro-batches at once."""
    model = make_model()
    opt = adamw(model.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(ga):
            xs, ys = zip(*(micro_batch(step, r, micro, micro_size) for r in range(world)))
            loss = model(torch.cat(xs), torch.cat(ys))
            (loss / ga if ga > 1 else loss).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_config(*, stage: int, ga: int = 1, clip: float = 0.0, lr: float = 1e-2,
                  micro_size: int = 4, bucket: int = 64, overlap: bool = False,
                  precision: str = "fp32", **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro_size,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                              "allgather_bucket_size": bucket, "overlap_comm": overlap},
        "steps_per_print": 10 ** 6,
    }
    if stage == 3:  # partition everything into several units (DeepSpeed's defaults would
        # keep this tiny model whole: every parameter is under the persistence threshold)
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                        stage3_prefetch_bucket_size=100)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True, "auto_cast": True}   # fp32 batches in
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "auto_cast": True}
    cfg.update(extra)
    return cfg


def train_engine(engine, *, steps: int, rank: int, ga: int, micro_size: int = 4) -> list[float]:
    """Drive an engine the DeepSpeed way; returns the mean micro-batch loss per step. The
    micro-batches go to the engine's device (the engine never moves inputs: a model on
    cuda:0 fed host batches would fail; it casts them only with ``auto_cast``)."""
    device = getattr(engine, "device", None)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(ga):
            batch = micro_batch(step, rank, micro, micro_size)
            if device is not None and device.type != "meta":
                batch = tuple(t.to(device) for t in batch)
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / ga)
    return losses


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


class RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises: a rank that fails in the middle of its backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in backward")


def tp_model(family: str) -> torch.nn.Module:
    """The tensor-parallel tests' tiny Hugging Face model (``"llama"`` or ``"gpt2"``): 4
    attention heads (2 key-value heads for Llama) so T = 2 splits them, no dropout."""
    import transformers
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


def tp_batch(step: int, dp_rank: int, micro: int) -> torch.Tensor:
    """Token ids of one data-parallel rank's micro-batch (``micro`` rows of 8) at ``step``:
    the same on every rank of a tensor-parallel group."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, 64, (micro, 8), generator=g)
