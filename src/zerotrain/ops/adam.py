"""``FusedAdam`` and ``DeepSpeedCPUAdam`` with DeepSpeed's constructor arguments.

Both are ``torch.optim.Adam`` with ``fused=True``: torch's fused kernel is exact Adam and
runs on CUDA and on the CPU, which is what DeepSpeed's compiled ``fused_adam`` and
``cpu_adam`` ops provide. ``adam_w_mode``/``adamw_mode`` (default on, as in DeepSpeed)
selects decoupled weight decay (AdamW); off, the weight decay is added to the gradient
(Adam's L2 penalty). Arguments torch's Adam cannot honour raise a ValueError naming them.
"""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters


def _adam_kwargs(cls_name: str, *, bias_correction: bool, decoupled: bool,
                 mode_name: str) -> dict[str, Any]:
    if not bias_correction:
        raise ValueError(f"{cls_name}(bias_correction=False) is not supported: torch's Adam "
                         "always corrects the moment estimates for bias")
    if decoupled and not _HAS_DECOUPLED:
        raise ValueError(f"{cls_name}({mode_name}=True) needs torch >= 2.6 (Adam's "
                         f"decoupled_weight_decay); use torch.optim.AdamW with this torch")
    return {"decoupled_weight_decay": decoupled} if _HAS_DECOUPLED else {}


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam``: torch's fused Adam, AdamW by default (``adam_w_mode``)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        extra = _adam_kwargs("FusedAdam", bias_correction=bias_correction,
                             decoupled=adam_w_mode, mode_name="adam_w_mode")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, fused=True, **extra)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=self.set_grad_none and set_to_none)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam``: torch's fused Adam on the CPU (the fast path on the
    host, as fast as DeepSpeed's compiled op), AdamW by default (``adamw_mode``).

    ``fp32_optimizer_states=False`` (DeepSpeed: keep the moments in the parameter dtype) is
    what torch's Adam does: its moments take the dtype of the tensors it steps. Under the
    engine those are the master shards: fp32, or bf16 with ``bf16.bf16_optimizer_states``,
    which (as in DeepSpeed) needs ``fp32_optimizer_states=False`` when this optimizer is the
    client's (``engine/optimizer_choice.refuse_fp32_cpu_adam_states``).
    """

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        extra = _adam_kwargs("DeepSpeedCPUAdam", bias_correction=bias_correction,
                             decoupled=adamw_mode, mode_name="adamw_mode")
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, fused=True, **extra)
        self.adamw_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
