"""DeepSpeed's ZeRO optimizer attributes that its users and tests read, from the engine.

Why a module of its own: DeepSpeed's ZeRO optimizers carry their internals as attributes
(``averaged_gradients``, ``fp16_groups``, ``fp32_partitioned_groups_flat``,
``forward_hooks``), and scripts and DeepSpeed's own tests read them. zerotrain's optimizer
is a torch optimizer over flat shards; which parameter each chunk belongs to is known to
the engine's stage. :class:`OptimizerViews` answers in DeepSpeed's shapes from the stage's
shard records; the engine's optimizer (``optim.ZeroOptimizer``) holds one and delegates.

Each is a read: new tensors (the gradients) or the live objects (parameters, masters,
hook handles), nothing the step depends on is copied back.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from ..errors import StateError
from ..utils import averaged_gradients_by_group, safe_get_full_grad


class OptimizerViews:
    """DeepSpeed's optimizer attributes, computed from ``engine`` (held weakly)."""

    def __init__(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)

    def engine(self) -> Any:
        engine = self._engine()
        if engine is None:
            raise StateError("the engine this optimizer belonged to is gone")
        return engine

    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """{group index: this rank's chunk of each parameter's averaged gradient}; empty
        when no backward ran since the last step (``utils.averaged_gradients_by_group``)."""
        return averaged_gradients_by_group(self.engine())

    def fp32_groups_gradients_flat(self) -> list[torch.Tensor]:
        """Per optimizer group, the whole averaged gradient of its parameters, flat, in the
        module's parameter order (DeepSpeed's bf16 optimizer's name). Collective: every rank
        calls it, as ``safe_get_full_grad``; a frozen parameter adds nothing."""
        named = list(self.engine().module.named_parameters())
        group_of = {n: r.group_index for r in self._trained_records() for n in r.names}
        out = []
        for g in sorted(set(group_of.values())):
            grads = [safe_get_full_grad(p) for n, p in named if group_of.get(n) == g]
            out.append(torch.cat([x.reshape(-1).float() for x in grads if x is not None]))
        return out

    def _trained_records(self) -> list[Any]:
        return [r for r in self.engine().stage.shard_records() if r.group_index >= 0]

    def fp16_groups(self) -> list[list[torch.nn.Parameter]]:
        """The model's parameters, one list per flat shard the optimizer steps (DeepSpeed's
        sub-groups at stage 3, its parameter groups at stages 1-2), in shard order."""
        by_name = dict(self.engine().module.named_parameters())
        return [[by_name[n] for n in r.names] for r in self._trained_records()]

    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """This rank's fp32 master shards, one per entry of :meth:`fp16_groups`; each is a
        key of ``optimizer.optimizer.state``."""
        return [r.master for r in self._trained_records()]

    def needs_scaler(self) -> bool:
        """Whether a loss backpropagated directly (``loss.backward()``) must go through
        ``engine.scale(loss)`` first: fp16, whose loss scaler (static or dynamic) the step
        divides out again; False for bf16 and fp32, which are never scaled."""
        return self.engine().fp16_enabled()

    def forward_hooks(self) -> list[Any]:
        """The handles of stage 3's forward hooks (none below stage 3, and none inside
        ``unwrap_model_for_generation``)."""
        handles = getattr(self.engine().stage, "forward_hook_handles", None)
        return handles() if handles is not None else []
