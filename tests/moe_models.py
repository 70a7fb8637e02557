"""A tiny routed mixture-of-experts model whose routing depends on the data, and its
single-process reference (tests of ranks that take different paths)."""
from __future__ import annotations

import torch
from torch import nn

IN, HIDDEN, OUT = 6, 8, 3


class Experts(nn.Module):
    """Top-1 routing: each sample goes to the expert its ``route`` names, scaled by the
    router's probability for it; experts no sample reaches do not run."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, n)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(n))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(h), dim=-1)
        out = torch.zeros_like(h)
        for e in sorted(set(route.tolist())):   # data dependent: only the experts hit
            mask = route == e
            out = out.index_put((mask,), self.experts[e](h[mask]) * gate[mask, e:e + 1])
        return h + out


class RoutedNet(nn.Module):
    def __init__(self, n_experts: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.moe = Experts(n_experts)
        self.head = nn.Linear(HIDDEN, OUT)
        self.skip_moe = False   # a rank that does not call the block (divergence tests)

    def forward(self, x, route, y):
        h = torch.tanh(self.inp(x))
        if not self.skip_moe:
            h = self.moe(h, route)
        return nn.functional.mse_loss(self.head(h), y)


def make_model(n_experts: int = 2, seed: int = 0) -> RoutedNet:
    torch.manual_seed(seed)
    return RoutedNet(n_experts)


def batch(step: int, rank: int, *, n_experts: int, size: int = 4, random_routes: bool):
    """Rank ``rank``'s micro-batch: with ``random_routes`` each sample picks an expert at
    random, else every sample of rank r goes to expert r (mod n)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(size, IN, generator=g), torch.randn(size, OUT, generator=g)
    if random_routes:
        route = torch.randint(0, n_experts, (size,), generator=g)
    else:
        route = torch.full((size,), rank % n_experts)
    return x, route, y


def reference(*, steps: int, world: int, n_experts: int, random_routes: bool,
              lr: float = 1e-2) -> dict[str, torch.Tensor]:
    """One process over every rank's samples at once (mean losses: equal micro-batches)."""
    model = make_model(n_experts)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        parts = [batch(step, r, n_experts=n_experts, random_routes=random_routes)
                 for r in range(world)]
        x, route, y = (torch.cat(t) for t in zip(*parts))
        model(x, route, y).backward()
        for p in model.parameters():   # an expert no sample reached: a zero gradient, as
            if p.grad is None:         # every rank contributes (AdamW still decays it)
                p.grad = torch.zeros_like(p)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- DeepSpeed's MoE layer
class LayerNet(nn.Module):
    """Two of DeepSpeed's MoE layers (``zerotrain.moe.layer.MoE``): top-1 with random token
    selection, tokens dropped (capacity 1 per expert) and a residual expert, then top-2
    with a sampled second expert; their auxiliary losses join the loss."""

    def __init__(self) -> None:
        from zerotrain.moe.layer import MoE
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))
        self.moe1 = MoE(HIDDEN, expert, num_experts=4, k=1, capacity_factor=0.5,
                        min_capacity=1, use_residual=True)
        self.moe2 = MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=3, k=2)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        out, aux1, _ = self.moe1(h)
        h = h + out
        out, aux2, _ = self.moe2(h)
        return nn.functional.mse_loss(self.head(h + out), y) + 0.01 * (aux1 + aux2)


def make_layer_model(seed: int = 0) -> LayerNet:
    torch.manual_seed(seed)
    return LayerNet()


def layer_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch at ``step``: 2 sequences of 4 tokens."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, OUT, generator=g)


def layer_reference(*, steps: int, world: int, lr: float = 1e-2) -> dict[str, torch.Tensor]:
    """One process: each rank's micro-batch in turn, the gate's random draws from the
    seed every rank sets before its forward (``torch.manual_seed(step)``), gradients
    averaged over the ranks (an expert no token reached: zero, as every rank sends)."""
    model = make_layer_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            model(*layer_batch(step, rank)).backward()
            for t, p in zip(total, params):
                if p.grad is not None:
                    t.add_(p.grad)
        for p, t in zip(params, total):
            p.grad = t.div_(world)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
