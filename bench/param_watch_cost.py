"""What the engine's ``_parameters`` containers cost (``stages/param_watch.py``): a parameter
read (``module.weight``) through torch's plain container and through ``ZeROOrderedDict``,
the per-forward walk of the modules, and a tiny stage-3 step in one process.

    PYTHONPATH=src python bench/param_watch_cost.py            # this tree
    PYTHONPATH=/path/to/older/src python bench/param_watch_cost.py --step-only

``--step-only`` measures only the step (a tree without the containers), ``--no-step`` all
but the step. CPU time of the
process (``time.process_time``), one intra-op thread, median of 5 rounds of 40 steps.
"""
from __future__ import annotations

import statistics
import sys
import time
import timeit

import torch
import torch.nn.functional as F
from torch import nn

import zerotrain

torch.set_num_threads(1)


class Nano(nn.Module):
    """tests/dist/test_zero3.py's model: 8 modules, a tied head, an external read."""

    def __init__(self, vocab: int = 37, width: int = 24) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.shared = nn.Linear(width, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        h = self.tok(idx)
        for block in self.blocks:
            h = torch.tanh(block(h))
        h = self.shared(self.shared(h))
        h = h + F.linear(h, self.mix.weight) * 0.1 + self.mix(h)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _best_ns(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e9


def container_costs() -> str:
    from zerotrain.stages.param_watch import ParameterWatch
    model = Nano()
    mix = model.mix
    plain = _best_ns(lambda: mix.weight, 100_000)
    watch = ParameterWatch(model, {id(p) for p in model.parameters()},
                           gather_external=lambda p: None)
    watch.install()
    watch.in_forward = True
    zero3 = _best_ns(lambda: mix.weight, 100_000)

    def walk() -> None:
        watch.begin_forward()
        watch.end_forward()
    walked = _best_ns(walk, 2_000)
    modules = sum(1 for _ in model.modules())
    watch.uninstall()
    # a model of many modules (24 blocks of 4 modules each and their containers)
    big = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8),
                                        nn.LayerNorm(8)) for _ in range(24)])
    big_watch = ParameterWatch(big, {id(p) for p in big.parameters()})
    big_watch.install()

    def walk_big() -> None:
        big_watch.begin_forward()
        big_watch.end_forward()
    walked_big = _best_ns(walk_big, 2_000)
    big_watch.uninstall()
    return (f"module.weight: plain {plain:.0f} ns, ZeROOrderedDict in forward {zero3:.0f} ns; "
            f"forward prologue of the watch with nothing attached since: {modules} modules "
            f"{walked / 1e3:.2f} us, {sum(1 for _ in big.modules())} modules "
            f"{walked_big / 1e3:.2f} us")


def step_cost() -> str:
    torch.manual_seed(0)
    model = Nano()
    config = {"train_batch_size": 2, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 200,
                                    "stage3_max_reuse_distance": 0}}
    zerotrain.zero.register_external_parameter(model, model.mix.weight)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = (idx, torch.roll(idx, 1, dims=1))
    for _ in range(10):
        engine.backward(engine(*batch))
        engine.step()
    rounds = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(40):
            engine.backward(engine(*batch))
            engine.step()
        rounds.append((time.process_time() - start) / 40 * 1e3)
    engine.destroy()
    return f"stage-3 step: median {statistics.median(rounds):.2f} ms, min {min(rounds):.2f} ms"


if __name__ == "__main__":
    if "--step-only" not in sys.argv:
        print(container_costs())
    if "--no-step" not in sys.argv:
        print(step_cost())
