"""The demo's results as files (CSV, PNG, JSON, text) and as the text the command prints.

matplotlib is optional (``pip install -e ".[demo]"``): without it the loss curve is still
written as CSV and the report says how to get the PNG.
"""
from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path
from typing import Optional

from zerotrain.estimate import BytesPerParam, Placement, fp32_accumulation_extra, gpu_shares

__all__ = ["write_report"]

_WIDTH = 96  # long lines of the report are wrapped to this many columns
_CATEGORIES = (("parameters", "params"), ("gradients", "grads"),
               ("optimizer_state", "optimizer"), ("buffers", None))


def _write_csv(history: dict, path: Path) -> None:
    val = dict(history["val"])
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "train_loss", "val_loss", "seconds"])
        writer.writerow([0, "", f"{val[0]:.4f}", "0.0"])
        for step, loss, seconds in history["train"]:
            writer.writerow([step, f"{loss:.4f}",
                             f"{val[step]:.4f}" if step in val else "", f"{seconds:.2f}"])


def _write_png(history: dict, path: Path, title: str) -> Optional[str]:
    """Draw the loss curve; None on success, else why not (matplotlib missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    steps, losses, _ = zip(*history["train"])
    ax.plot(steps, losses, lw=1, alpha=0.7, label="train (mean over ranks)")
    val_steps, val_losses = zip(*history["val"])
    ax.plot(val_steps, val_losses, "o-", lw=2, label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def _precision(config: dict) -> str:
    if config.get("fp16", {}).get("enabled"):
        return "fp16"
    bf16 = config.get("bf16", config.get("bfloat16", {}))
    return "bf16" if bf16.get("enabled") else "fp32"


def _memory_lines(results: dict, config: dict) -> list[str]:
    """Measured bytes per rank next to the ZeRO formula for the stage that ran."""
    psi, world, stage = results["num_params"], results["world_size"], results["stage"]
    dtype = _precision(config)
    optimizer = "sgd" if config.get("optimizer", {}).get("type", "").lower() == "sgd" else "adam"
    if (optimizer == "adam" and dtype == "bf16"
            and config.get("bf16", {}).get("bf16_master_weights_and_grads")):
        optimizer = "adam-bf16"   # bf16 masters, gradients and moments (docs/memory.md)
    shares = gpu_shares(Placement(stage), BytesPerParam.of(dtype, optimizer))
    extra = fp32_accumulation_extra(psi, Placement(stage), world=world, dtype=dtype,
                                    optimizer=optimizer)
    ranks = results["memory"]
    head = ["category", "ZeRO formula"] + [f"rank {r}" for r in range(len(ranks))]
    rows = [head]
    for category, key in _CATEGORIES:
        if key is None:
            formula = "-"
        else:
            per_param, sharded = shares[key]
            nbytes = psi * per_param / (world if sharded else 1)
            if key == "grads" and extra:
                nbytes += extra
            formula = (f"{per_param}Ψ{'/N' if sharded else ''} = {nbytes / 1e6:.2f}"
                       + (" (+fp32 accum)" if key == "grads" and extra else ""))
        rows.append([category, formula] + [f"{m.get(category, 0) / 1e6:.2f}" for m in ranks])
    for key, name in (("peak_measured", "peak of the last step"),
                      ("peak_predicted", "  predicted (planner)")):
        if any(key in m for m in ranks):
            rows.append([name, "-"] + [f"{m[key] / 1e6:.2f}" if key in m else "-"
                                       for m in ranks])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    table = ["  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                              for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    title = (f"Memory per rank in MB after the last step (engine.memory_breakdown(), gathered "
             f"to rank 0) against ZeRO-{stage}'s formula, {dtype} {optimizer}, Ψ = {psi:,}, "
             f"N = {world}:")
    notes = ["  Beyond the formula: padding of each parameter to a multiple of N"]
    if dtype == "fp32" and stage in (1, 2):
        notes.append("the optimizer's own fp32 shard of the weights (+4Ψ/N in optimizer_state; "
                     "the fp32 formula counts the weights once)")
    if stage == 3:
        notes.append("parameters under stage3_param_persistence_threshold, whole on every rank")
    if stage >= 2 and all(not m.get("gradients") for m in ranks):
        notes.append("gradients read 0 because their shards are freed once the step has used "
                     "them; the formula's figure is held from backward to the step")
    return (textwrap.wrap(title, _WIDTH) + table
            + textwrap.wrap("; ".join(notes) + ".", _WIDTH, initial_indent="  ",
                            subsequent_indent="  "))


def _timing_line(results: dict, launched_at: float, finished_at: float) -> str:
    """Where the wall time went: start-up, training (with evaluations), the rest."""
    marks = results["marks"]
    phases = [("start-up (processes, imports, initialize)", marks["initialized"] - launched_at),
              ("training and evaluation", marks["trained"] - marks["initialized"]),
              ("sample, memory, checkpoint, shutdown", finished_at - marks["trained"])]
    return (f"Wall time {finished_at - launched_at:.1f} s: "
            + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases) + ".")


def write_report(results: dict, *, config: dict, out_dir: Path, launched_at: float,
                 finished_at: float) -> str:
    """Write loss.csv, loss.png, sample.txt and summary.json into ``out_dir``; return the text
    to print. ``launched_at``/``finished_at`` are ``time.time()`` around the launch."""
    wall_seconds = finished_at - launched_at
    history = results["history"]
    _write_csv(history, out_dir / "loss.csv")
    stage, world = results["stage"], results["world_size"]
    png_problem = _write_png(history, out_dir / "loss.png",
                             f"byte-level GPT, ZeRO-{stage}, {world} CPU processes")
    (out_dir / "sample.txt").write_text(results["sample"], encoding="utf-8")
    (out_dir / "summary.json").write_text(json.dumps(
        {**results, "wall_seconds": wall_seconds}, indent=2, default=str) + "\n")
    before, after = history["val"][0][1], history["val"][-1][1]
    steps = len(history["train"])
    train_s = history["train_seconds"]
    lines = [
        "",
        f"Validation loss: {before:.3f} before training -> {after:.3f} after {steps} steps "
        f"(nats per byte; a uniform guess is {results['val_loss_uniform']:.3f}).",
        f"Data: {results['train_files']} standard-library files for training "
        f"({results['train_bytes'] / 1e6:.1f} MB), {results['val_files']} held out.",
        f"Training: {train_s / steps:.2f} s per step, "
        f"{history['tokens_per_step'] * steps / train_s:,.0f} tokens/s over all ranks.",
        _timing_line(results, launched_at, finished_at), "",
        'Sample (top-k 5 after "def "):', "",
        *("    " + line for line in results["sample"].splitlines()), "",
        *_memory_lines(results, config), "",
    ]
    checkpoint = results.get("checkpoint")
    if checkpoint is None:
        lines.append("Checkpoint: not saved (this zerotrain has no engine.save_checkpoint).")
    else:
        lines.append(f"Checkpoint: {checkpoint}")
    if png_problem:
        lines.append(f"Loss curve: loss.csv (no loss.png: {png_problem}; "
                     "pip install -e \".[demo]\" or pip install matplotlib for the PNG).")
    else:
        lines.append("Loss curve: loss.png (and loss.csv).")
    lines.append(f"Output folder: {out_dir}")
    return "\n".join(lines)
