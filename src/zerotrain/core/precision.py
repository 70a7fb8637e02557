"""Mixed-precision policy and fp16 loss scaling.

Note: master weights
    With bf16 or fp16 the module holds 16-bit parameters and the optimizer steps an fp32
    copy of this rank's shard (the master weights). With fp32 there is no master copy: where
    a rank's shard is the whole group (stage 0, or world size 1) the parameters are views of
    the very tensor the optimizer steps.

Note: bf16 masters
    ``bf16.bf16_master_weights_and_grads`` with ``bf16_optimizer_states`` (DeepSpeed's keys)
    make ``master_dtype`` bf16: the masters are bf16 (at stage 3 the parameter shard is the
    master, as in DeepSpeed, which keeps no second copy when the dtypes agree), gradients
    are accumulated and reduced in bf16 (``grad_accum_dtype``), and the optimizer, stepping
    bf16 tensors, creates its state in bf16. Each update still averages, unscales and clips
    in fp32 and rounds the result to bf16 once (``offload/gradients.as_grad_of``). What is
    lost: an update smaller than half a bf16 ulp of the weight (2**-9 to 2**-8 of it) is rounded
    away, where fp32 masters would accumulate it (docs/memory.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtypes each role uses.

    param_dtype: the module's floating-point parameters and activations.
    grad_accum_dtype: gradients accumulated over micro-steps and reduced over ranks.
    master_dtype: what the optimizer steps: fp32, or bf16 (Note: bf16 masters).
    comm_dtype: gradient reductions on the wire (``communication_data_type``); None means
    the gradients' own dtype, ``param_dtype``.
    """

    param_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    comm_dtype: Optional[torch.dtype] = None

    @classmethod
    def from_names(cls, precision: str, grad_accum: str, comm: Optional[str] = None,
                   master: str = "fp32") -> "PrecisionPolicy":
        return cls(param_dtype=DTYPES[precision], grad_accum_dtype=DTYPES[grad_accum],
                   master_dtype=DTYPES[master], comm_dtype=DTYPES[comm] if comm else None)

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced over ranks in (Note "communication dtype" in
        buckets.py)."""
        return self.comm_dtype or self.param_dtype

    @property
    def has_master_copy(self) -> bool:
        return self.param_dtype != self.master_dtype

    def cast_inputs(self, value):
        """Cast floating tensors (nested in lists, tuples, dicts) to the parameter dtype."""
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.dtype != self.param_dtype:
                return value.to(self.param_dtype)
            return value
        if isinstance(value, (list, tuple)):
            cast = [self.cast_inputs(v) for v in value]
            return type(value)(cast) if not hasattr(value, "_fields") else type(value)(*cast)
        if isinstance(value, dict):
            return {k: self.cast_inputs(v) for k, v in value.items()}
        return value


class LossScaler:
    """DeepSpeed's loss scaler: static when ``dynamic`` is False, else dynamic.

    Dynamic scaling: an overflow consumes one unit of hysteresis; once hysteresis is spent
    the scale is divided by ``scale_factor`` (never below ``min_scale``). After
    ``scale_window`` consecutive steps without overflow the scale is multiplied by
    ``scale_factor`` (and, with ``consecutive_hysteresis``, hysteresis is restored).
    """

    def __init__(self, *, init_scale: float, dynamic: bool, scale_window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False,
                 min_scale: float = 1.0, scale_factor: float = 2.0) -> None:
        self.loss_scale = float(init_scale)
        self.dynamic = dynamic
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.scale_factor = float(scale_factor)
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, fp16) -> Optional["LossScaler"]:
        """The scaler for a ``fp16`` config section, or None when fp16 is off."""
        if not fp16.enabled:
            return None
        if fp16.loss_scale and fp16.loss_scale > 0:
            return cls(init_scale=fp16.loss_scale, dynamic=False)
        return cls(init_scale=2.0 ** fp16.initial_scale_power, dynamic=True,
                   scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                   consecutive_hysteresis=fp16.consecutive_hysteresis,
                   min_scale=fp16.min_loss_scale)

    # an fp16 scaler takes every non-finite gradient for an overflow and skips the step
    skips_overflows = True

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from: ``loss * loss_scale``."""
        return loss * self.loss_scale

    def for_checkpoint(self) -> "LossScaler":
        """What a checkpoint saves and restores: this scaler's ``state_dict``."""
        return self

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step; ``overflow`` must be the same on every rank."""
        if self.dynamic:
            if overflow:
                if self.cur_hysteresis <= 1:
                    self.loss_scale = max(self.loss_scale / self.scale_factor, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.cur_iter
            else:
                if self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                    if not self.consecutive_hysteresis:
                        self.cur_hysteresis = self.hysteresis
                    self.loss_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in (
            "loss_scale", "dynamic", "scale_window", "hysteresis", "cur_hysteresis",
            "consecutive_hysteresis", "min_scale", "scale_factor", "cur_iter",
            "last_overflow_iter")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class NoLossScaling:
    """fp32 and bf16: the loss is not scaled. The same interface as :class:`LossScaler`,
    so the engine asks its questions of either and never tests for fp16."""

    loss_scale = 1.0
    # a non-finite gradient is not an overflow: the ``nonfinite`` setting decides
    skips_overflows = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss itself, unchanged."""
        return loss

    def update(self, overflow: bool) -> None:
        """Nothing to adjust."""

    def for_checkpoint(self) -> None:
        """None: there is no scaler state, and the checkpoint records null for it."""
        return None


class LossScaling(Protocol):
    """What the engine asks of loss scaling: :class:`LossScaler` or :class:`NoLossScaling`."""

    loss_scale: float
    skips_overflows: bool

    def scale(self, loss: torch.Tensor) -> torch.Tensor: ...

    def update(self, overflow: bool) -> None: ...

    def for_checkpoint(self) -> Optional[LossScaler]: ...


def loss_scaling(fp16) -> LossScaling:
    """The loss scaling for a ``fp16`` config section: a :class:`LossScaler` when fp16 is
    enabled, else :class:`NoLossScaling`."""
    scaler = LossScaler.from_config(fp16)
    return NoLossScaling() if scaler is None else scaler
