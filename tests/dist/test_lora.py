"""A LoRA-style model at stage 3: a frozen base (embedding, layer norms, linears, tied head)
with trainable low-rank adapters, every parameter partitioned (persistence threshold 0).

Each block applies a frozen layer norm before a LoRA linear, so backward needs the norm's
frozen weight after the adapter's gradients are in; the wrapper's ``generate`` calls the
inner model directly, never the wrapped root's forward, so the embedding, final norm and
tied head (owned by the root's unit) are gathered by their own modules; each block modifies
its input in place. Training and generation must match stage 0.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import reference as R

VOCAB, WIDTH, RANK = 29, 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.proj = R.LoraLinear(WIDTH, WIDTH, RANK)

    def forward(self, x):
        x.mul_(1.0)   # a forward may modify its input in place
        return x + torch.tanh(self.proj(self.norm(x)))


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        h = self.tok(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Adapter(nn.Module):
    """What a PEFT wrapper does: its forward trains, its generate calls the inner model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Base()
        for name, p in self.model.named_parameters():
            p.requires_grad_("lora_" in name)

    def forward(self, idx, targets):
        logits = self.model(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def generate(self, idx, steps: int):
        for _ in range(steps):
            nxt = self.model(idx)[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def _run(rank, world, stage, zero_init):
    import zerotrain
    torch.manual_seed(0)
    if zero_init:
        with zerotrain.zero.Init():
            model = Adapter()
    else:
        model = Adapter()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0}}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = zerotrain.initialize(model=model, model_parameters=trainable, config=config)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        idx = torch.randint(0, VOCAB, (2, 7), generator=g)
        loss = engine(idx, torch.roll(idx, 1, dims=1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    prompt = torch.tensor([[1, 2, 3]])
    generated = engine.module.generate(prompt, 4).tolist()
    released = all(p.numel() == 0 for p in model.parameters()) if stage == 3 else True
    return {"losses": losses, "generated": generated, "released": released}


def _grid(rank, world):
    return {case: _run(rank, world, *case) for case in ((0, False), (3, False), (3, True))}


def test_lora_with_frozen_norm_trains_and_generates_through_a_wrapper_at_stage3(worlds):
    for res in worlds.run(2, _grid):
        plain = res[(0, False)]
        for case in ((3, False), (3, True)):
            assert res[case]["losses"] == pytest.approx(plain["losses"], abs=1e-5), case
            assert res[case]["generated"] == plain["generated"], (case, res[case], plain)
            assert res[case]["released"], case
