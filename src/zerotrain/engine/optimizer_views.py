"""DeepSpeed's ZeRO optimizer attributes that its users and tests read, from the engine.

Why a module of its own: DeepSpeed's ZeRO optimizers carry their internals as attributes
(``averaged_gradients``, ``fp16_groups``, ``fp32_partitioned_groups_flat``,
``forward_hooks``), and scripts and DeepSpeed's own tests read them. zerotrain's optimizer
is a torch optimizer over flat shards; which parameter each chunk belongs to is known to
the engine's stage. :class:`OptimizerViews` answers in DeepSpeed's shapes from the stage's
shard records; the engine's optimizer (``optim.ZeroOptimizer``) holds one and delegates.

Each is a read: new tensors (the gradients) or the live objects (parameters, masters,
hook handles), nothing the step depends on is copied back. Two are actions, DeepSpeed's
ZeRO optimizer's own: ``zero_grad`` and ``step``.

Note: optimizer.step() without engine.step()
    DeepSpeed's tests (and some loops) call ``engine.backward(loss)`` one or more times and
    then ``optimizer.step()``, never ``engine.step()``. The optimizer's step is the
    engine's update (``ZeroEngine.optimizer_step``, which runs the code ``engine.step()``
    runs at a boundary: reduce what is left, unscale and clip, overflow check, update, clear the
    gradients, fp16 loss scale), so the weights equal ``engine.step()``'s bit for bit; like
    DeepSpeed's it leaves the LR scheduler, ``global_steps`` and the micro-step count
    alone. Backwards without a step accumulate, each divided by
    ``gradient_accumulation_steps``, as DeepSpeed's do. It is refused, naming why, where
    it would train on the wrong gradients: before any backward since the last update, when
    the stage reduces only at the accumulation boundary (stages 0-1) and the last backward
    was not one, in the middle of a window ``engine.step()`` has been counting (the window
    would end early), inside ``no_sync``, and a second update in one window
    (``engine.step()`` after ``optimizer.step()``, or the reverse). With
    ``managed_gradient_accumulation: false`` it ends the caller's window wherever it comes,
    as ``engine.step()`` does there (Note "unmanaged accumulation" in accumulation.py).

    ``optimizer.zero_grad()`` is DeepSpeed's: the next backward starts the gradients afresh
    (the ones accumulated so far are dropped when it begins, ``engine.zero_grad()``),
    while a step taken before that backward still uses them, as DeepSpeed's stage 3 does
    (its zero_grad resets the micro-step count that makes the next reduction overwrite
    rather than add; its reduced partitions stay for the step). In the middle of a window
    that ``engine.step()`` is counting it is refused: a loop that zeroes before every
    micro-batch would train on the window's last micro-batch alone.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from ..errors import StateError
from .full_params import parameter_records, safe_get_full_grad
from .group_gradients import averaged_gradients_by_group


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
        return [r for r in parameter_records(self.engine()) if r.group_index >= 0]

    def fp16_groups(self) -> list[list[torch.nn.Parameter]]:
        """The model's parameters, one list per flat shard the optimizer steps (DeepSpeed's
        sub-groups at stage 3, its parameter groups at stages 1-2), in shard order."""
        by_name = dict(self.engine().module.named_parameters())
        return [[by_name[n] for n in r.names] for r in self._trained_records()]

    def bit16_groups_flat(self) -> list[torch.Tensor]:
        """Per entry of :meth:`fp16_groups`, its parameters' current values in the training
        dtype, flat and detached, on their device (DeepSpeed's stage 1-2 name). A copy:
        zerotrain's parameters are not views into one flat buffer, so writing into it
        changes no parameter. Stage 3 has no such list (its parameters are partitioned),
        as DeepSpeed's stage 3 optimizer has none."""
        if self.engine().stage.partitions_parameters:
            raise AttributeError("bit16_groups_flat is a stage 1-2 attribute; at stage 3 "
                                 "the parameters are partitioned (see fp16_groups)")
        return [torch.cat([p.detach().reshape(-1) for p in params])
                for params in self.fp16_groups()]

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
        return self.engine().stage.forward_hook_handles()

    def parameter_offload(self) -> Any:
        """Stage 3's hooks object under DeepSpeed's name (``parameter_offload.py``); an
        AttributeError below stage 3, where DeepSpeed's optimizer has none either."""
        engine = self.engine()
        if not engine.stage.partitions_parameters:
            raise AttributeError(
                "parameter_offload is a ZeRO stage 3 attribute (the module hooks that gather "
                f"parameters); this engine runs stage {engine.zero_optimization_stage()}")
        offload = self.__dict__.get("_parameter_offload")
        if offload is None:
            from .parameter_offload import ParameterOffload
            offload = self.__dict__["_parameter_offload"] = ParameterOffload(engine)
        return offload

    def micro_step_id(self) -> int:
        """DeepSpeed's stage-3 count: the backwards whose gradients were reduced into the
        partitioned gradients since the last update (0: the next reduction starts them
        afresh). A backward inside ``coalesce_grad_reduction()`` reduces nothing; the
        block's exit counts once. 0 after ``optimizer.zero_grad()``, whose drop takes
        effect at the next backward. Stage 3 only: DeepSpeed's stage 1-2 optimizer counts
        differently (from -1)."""
        engine = self.engine()
        if not engine.stage.partitions_parameters:
            raise AttributeError(
                "micro_step_id is a ZeRO stage 3 attribute here (the backwards reduced into "
                f"the partitioned gradients since the last update); this engine runs stage "
                f"{engine.zero_optimization_stage()}")
        return (0 if engine.accumulation_window.drop_grads_at_backward
                else engine.stage.reductions_this_window)

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """DeepSpeed's stage-3 ``{group index: {parameter index: fp32 chunk}}``: this rank's
        chunk of each trained parameter's averaged gradient (:meth:`averaged_gradients`,
        zero-padded to the chunk size; unscaled, where DeepSpeed's still carries the fp16
        loss scale), parameters numbered in the module's order within their group."""
        return {g: dict(enumerate(chunks)) for g, chunks in self.averaged_gradients().items()}

    def zero_grad(self) -> None:
        """The next backward drops the gradients accumulated since the last update before
        adding its own (Note: optimizer.step() without engine.step()). Refused in the
        middle of a window ``engine.step()`` is counting, where it would drop that window's
        first micro-steps (a loop that zeroes before every micro-batch)."""
        engine = self.engine()
        window = engine.accumulation_window
        steps = engine.gradient_accumulation_steps()
        if (window.boundary_override is None and engine.micro_steps % steps
                and window.backward_in_window and engine.managed_gradient_accumulation()):
            raise StateError(
                f"optimizer.zero_grad() at micro step {engine.micro_steps % steps + 1} of "
                f"{steps} of an accumulation window would drop the gradients of its first "
                f"{engine.micro_steps % steps} micro-step(s) (DeepSpeed drops them too); "
                "engine.step() clears the gradients after each update: remove the call, or "
                "call engine.zero_grad() to drop them on purpose")
        window.request_drop_at_backward()

    def step(self) -> None:
        """The engine's update without ``engine.step()`` (Note: optimizer.step() without
        engine.step()): ``engine.optimizer_step()``. Collective, as ``engine.step()``."""
        self.engine().optimizer_step()
