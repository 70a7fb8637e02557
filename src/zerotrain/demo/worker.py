"""What each demo rank runs: build the model, train it with ZeRO, evaluate, sample, measure.

:func:`train` is the entry point torchrun's machinery starts in every worker process. It
returns a picklable dict, which the launcher collects: rank 0's holds the results.

Note: lockstep
    Every collective must be called by all ranks in the same order, and at stage 3 the
    forward pass itself gathers parameters. So evaluation, sampling and the memory report
    run on every rank, each doing the same number of forward passes (validation windows are
    split evenly; sampling uses one seed, so every rank draws the same tokens), and only
    rank 0 prints.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

import zerotrain
from zerotrain.errors import ConfigError
from zerotrain.planner import PlanError, predict_engine_peak
from .data import Corpus, load_corpus
from .model import GPT, GPTConfig, generate

__all__ = ["DemoSettings", "train"]

PROMPT = "def "
_VAL_WINDOWS_PER_RANK = 16


@dataclass(frozen=True)
class DemoSettings:
    """Everything a worker needs; pickled to each spawned process."""

    config: dict
    model: GPTConfig
    steps: int
    out_dir: str
    eval_every: int
    seed: int = 0
    sample_tokens: int = 160
    progress: bool = True


class _Progress:
    """A carriage-return progress bar on stderr (a line per 10% when not a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self.last_decile = -1
        self.shown = 0  # length of the line on screen, to blank what a shorter one leaves

    def update(self, step: int, loss: float, tokens_per_s: float, step_s: float) -> None:
        if not self.enabled:
            return
        width = 24
        filled = round(width * step / self.total)
        text = (f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total}  "
                f"loss {loss:.3f}  {tokens_per_s:,.0f} tok/s  {step_s * 1e3:.0f} ms/step")
        decile = 10 * step // self.total
        if self.tty:
            print("\r" + text.ljust(self.shown), end="\n" if step == self.total else "",
                  file=sys.stderr, flush=True)
            self.shown = len(text)
        elif decile != self.last_decile:
            print(text, file=sys.stderr, flush=True)
        self.last_decile = decile


def _evaluate(engine: Any, corpus: Corpus, block: int) -> float:
    """Mean validation loss over the fixed windows, all ranks together (Note "lockstep")."""
    world, rank = engine.world_size, engine.global_rank
    x, y = corpus.val_batch(_VAL_WINDOWS_PER_RANK * world, block, rank=rank, world=world)
    engine.eval()
    with torch.no_grad():
        loss = float(engine(x.to(engine.device), y.to(engine.device)))
    engine.train()
    losses = engine.comm.all_gather_object(loss)  # equal shares: the mean of the means
    return sum(losses) / len(losses)


def _sample(engine: Any, settings: DemoSettings) -> str:
    """Top-k text after :data:`PROMPT`, drawn identically on every rank."""
    generator = torch.Generator().manual_seed(settings.seed + 1234)
    prompt = torch.tensor(list(PROMPT.encode()), dtype=torch.long, device=engine.device)
    engine.eval()
    with zerotrain.zero.GatheredParameters(list(engine.module.parameters())):
        ids = generate(lambda idx: engine(idx), prompt, new_tokens=settings.sample_tokens,
                       block_size=settings.model.block_size, top_k=5, temperature=0.8,
                       generator=generator)
    engine.train()
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


def _mean_loss(engine: Any, loss: torch.Tensor) -> float:
    total = loss.detach().float().reshape(1).clone()
    engine.comm.all_reduce(total)
    return float(total) / engine.world_size


def _train_loop(engine: Any, corpus: Corpus, settings: DemoSettings, history: dict) -> None:
    block = settings.model.block_size
    micro = engine.train_micro_batch_size_per_gpu()
    tokens_per_step = micro * block * engine.gradient_accumulation_steps() * engine.world_size
    generator = torch.Generator().manual_seed(settings.seed * 1000 + engine.global_rank)
    progress = _Progress(settings.steps, settings.progress and engine.global_rank == 0)
    started, cpu_started = time.perf_counter(), time.process_time()
    while engine.global_steps < settings.steps:
        step_start = time.perf_counter()
        losses = []
        # the last step's peak, measured (opt-in: it checks after every operation) for the
        # memory table, beside the planner's prediction
        last = engine.global_steps == settings.steps - 1
        with engine.measure_peak() if last else contextlib.nullcontext():
            for _ in range(engine.gradient_accumulation_steps()):
                x, y = corpus.train_batch(micro, block, generator)
                loss = engine(x.to(engine.device), y.to(engine.device))
                engine.backward(loss)
                engine.step()
                losses.append(_mean_loss(engine, loss))
        step, step_s = engine.global_steps, time.perf_counter() - step_start
        history["train"].append((step, sum(losses) / len(losses), time.perf_counter() - started))
        progress.update(step, history["train"][-1][1], tokens_per_step / step_s, step_s)
        if step == settings.steps:  # the training state the ZeRO formula describes
            if engine.global_rank == 0:   # the same on every rank: traced once
                _predict_peak(engine, settings, (x, y))
            history["memory"] = engine.comm.all_gather_object(engine.memory_breakdown())
        if step % settings.eval_every == 0 or step == settings.steps:
            history["val"].append((step, _evaluate(engine, corpus, block)))
    history["train_seconds"] = time.perf_counter() - started
    history["train_cpu_seconds"] = time.process_time() - cpu_started  # this rank's CPU time
    history["tokens_per_step"] = tokens_per_step


def _predict_peak(engine: Any, settings: DemoSettings, batch: tuple) -> None:
    """The planner's peak of a step of this run (``engine.memory_breakdown()`` reports it);
    a model the planner cannot trace leaves the table without it, and says why."""
    try:
        predict_engine_peak(engine, functools.partial(GPT, settings.model), batch,
                            settings.config)
    except PlanError as exc:
        print(f"no predicted peak: {exc}", file=sys.stderr)


def _checkpoint(engine: Any, out_dir: str) -> Optional[str]:
    """Save through ``engine.save_checkpoint`` where this zerotrain has it; the path or why not."""
    if not hasattr(engine, "save_checkpoint"):
        return None
    path = os.path.join(out_dir, "checkpoint")
    try:
        engine.save_checkpoint(path)
    except Exception as exc:  # report it with the other results instead of losing them
        return f"failed: {type(exc).__name__}: {exc}"
    return path


def train(settings: DemoSettings) -> dict:
    """One rank of the demo (started by ``elastic_launch``); returns results on rank 0 and
    ``{"rank": r}`` elsewhere, or ``{"error": message}`` if the config is refused."""
    marks = {"worker_start": time.time()}
    torch.set_num_threads(1)  # one core per rank: threads would fight over the same cores
    zerotrain.init_distributed(verbose=False)
    corpus = load_corpus()
    torch.manual_seed(settings.seed)
    model = GPT(settings.model)
    try:
        engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(),
                                               config=settings.config)
    except ConfigError as exc:  # raised alike on every rank, before training starts
        return {"error": str(exc)}
    marks["initialized"] = time.time()
    history: dict = {"train": [], "val": [(0, _evaluate(engine, corpus,
                                                        settings.model.block_size))]}
    _train_loop(engine, corpus, settings, history)
    marks["trained"] = time.time()
    sample = _sample(engine, settings)
    marks["sampled"] = time.time()
    checkpoint = _checkpoint(engine, settings.out_dir)
    marks["done"] = time.time()
    if engine.global_rank != 0:
        return {"rank": engine.global_rank}
    return {"rank": 0, "history": history, "sample": sample, "memory": history.pop("memory"),
            "checkpoint": checkpoint, "world_size": engine.world_size,
            "stage": engine.zero_optimization_stage(), "marks": marks,
            "num_params": _num_params(settings.model), "train_files": corpus.train_files,
            "val_files": corpus.val_files, "train_bytes": len(corpus.train),
            "val_bytes": len(corpus.val), "val_loss_uniform": math.log(256)}


def _num_params(cfg: GPTConfig) -> int:
    """Parameters of the demo GPT, counted on the meta device (stage 3 shards the real ones)."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())
