"""The GPT that the one-GPU benches train (``zero_gpu.py``, ``offload_gpu.py``).

nanoGPT's shape: learned positions, pre-LayerNorm blocks, fused QKV, causal SDPA, GELU MLP.
The loss is computed in fp32 (``logits.float()``) whatever the compute dtype. Parameters per
block: ``12 * d_model**2 + 13 * d_model``; plus ``vocab * d_model`` for the token embedding,
``seq * d_model`` for positions and, unless tied, another ``vocab * d_model`` for the head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 50304


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """``forward(idx, targets)`` returns the mean cross-entropy (fp32 scalar).

    ``tie_head=True`` shares the head's weight with the token embedding (``zero_gpu.py``'s
    1.3B); ``offload_gpu.py`` unties it so its sizes match the Pythia models they are named
    after (1.4B, 6.9B).
    """

    def __init__(self, d_model: int, n_layer: int, n_head: int, seq: int, *,
                 vocab: int = VOCAB, tie_head: bool = True, recompute: bool = False) -> None:
        super().__init__()
        self.vocab = vocab
        self.recompute = recompute  # activation checkpointing: blocks recomputed in backward
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tie_head:
            self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, self.vocab), targets.view(-1))
