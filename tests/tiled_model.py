"""A tiny decoder-shaped model whose MLP and logits+loss can run tiled along the sequence
(``zerotrain.sequence.tiled``), for the tiled-compute tests: tiled and plain runs share
weights, so their outputs and gradients can be compared."""
from __future__ import annotations

import importlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, INTER, SEQ = 48, 16, 40, 24
# where TiledMLP and TiledFusedLogitsLoss come from (the DeepSpeed comparison swaps it)
TILED = "zerotrain.sequence.tiled"


def tiled():
    return importlib.import_module(TILED)


class MLP(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), optionally tiled."""

    def __init__(self, shards: int = 1) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.shards = shards

    def plain(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x):
        if self.shards == 1:
            return self.plain(x)
        params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
        return tiled().TiledMLP.apply(MLP.plain, self, x, self.shards, params)


class TinyLM(nn.Module):
    """embed -> (x + mlp(x)) x depth -> norm -> lm_head -> cross-entropy (sum / count)."""

    def __init__(self, mlp_shards: int = 1, loss_shards: int = 1, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mlps = nn.ModuleList(MLP(mlp_shards) for _ in range(depth))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.loss_shards = loss_shards

    def hidden(self, ids):
        h = self.embed(ids)
        for mlp in self.mlps:
            h = h + mlp(h)
        return self.norm(h)

    @staticmethod
    def tile_loss(self, x, y):
        logits = self.lm_head(x).float()
        return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), reduction="sum",
                               ignore_index=-100)

    def forward(self, ids, labels):
        h = self.hidden(ids)
        count = (labels != -100).sum().clamp(min=1)
        if self.loss_shards == 1:
            return TinyLM.tile_loss(self, h, labels) / count
        total = tiled().TiledFusedLogitsLoss.apply(TinyLM.tile_loss, self, h, labels, None,
                                           self.loss_shards, [self.lm_head.weight], "sum")
        return total / count


def batch(step: int, rank: int, bs: int = 2, seq: int = SEQ):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, VOCAB, (bs, seq), generator=g)
    labels = torch.randint(0, VOCAB, (bs, seq), generator=g)
    labels[:, :3] = -100
    return ids, labels


def gradients(mlp_shards: int, loss_shards: int, *, scale: float = 1.0,
              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One forward/backward of a seeded model: the loss, the embedding output's gradient
    and every weight's gradient (``scale`` multiplies the loss before backward)."""
    torch.manual_seed(0)
    model = TinyLM(mlp_shards, loss_shards).to(dtype)
    ids, labels = batch(0, 0)
    loss = model(ids, labels)
    (loss * scale).backward()
    out = {"loss": loss.detach().float()}
    out.update({n: p.grad.detach().float().clone() for n, p in model.named_parameters()})
    return out


if __name__ == "__main__":   # python tiled_model.py <module> <out.pt> <mlp> <loss> <scale>
    TILED = sys.argv[1]
    torch.save(gradients(int(sys.argv[3]), int(sys.argv[4]), scale=float(sys.argv[5])),
               sys.argv[2])
