"""The runs tests/dist/test_low_precision.py compares between zerotrain and DeepSpeed
(tests/ds_scripts/low_precision_ds.py): bf16 masters, gradients and Adam moments
(``bf16``), the same under ``torch_autocast`` as DeepSpeed's bf16 example configures it
(``bf16_autocast``), and ``torch_autocast`` over fp32 parameters with every gradient
reduced in fp32 (``autocast``)."""
from __future__ import annotations

import torch

import reference as R

STEPS = 3
MODES = ("bf16", "bf16_autocast", "autocast")


def config(mode: str, stage: int, **extra) -> dict:
    if mode in ("bf16", "bf16_autocast"):
        cfg = R.engine_config(stage=stage, precision="bf16", **extra)
        cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        if mode == "bf16_autocast":
            cfg["torch_autocast"] = {"enabled": True, "dtype": "torch.bfloat16"}
        return cfg
    cfg = R.engine_config(stage=stage, **extra)
    cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16",
                             "lower_precision_safe_modules": []}
    cfg.setdefault("bf16", {"enabled": False})
    return cfg


def model() -> torch.nn.Module:
    return R.make_model()


def batch(mode: str, step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch of ``rank`` at ``step``: bf16 for bf16 parameters (DeepSpeed casts
    nothing), fp32 under autocast."""
    x, y = R.micro_batch(step, rank, micro)
    return (x, y) if mode == "autocast" else (x.bfloat16(), y.bfloat16())
