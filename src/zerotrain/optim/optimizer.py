"""Optimizers over shards: built from the config, or a client optimizer re-targeted.

Note: one flat tensor per group
    The optimizer never sees the module's parameters. Each optimizer parameter group gets one
    flat fp32 tensor, this rank's shard of that group (see ``flat.py``), and the group keeps
    its hyperparameters. Adam, AdamW and SGD are elementwise, so stepping a flat shard is the
    same arithmetic as stepping each parameter.

Note: client optimizers
    A client optimizer object passed to ``initialize`` is kept and re-targeted: its groups'
    ``params`` are replaced by the shards and its (empty) state is reset. The user's
    references stay valid, so an ``lr_scheduler`` built on that optimizer keeps working.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import ConfigError, StateError
from ..muon.sharded import MATRIX_OPTIMIZERS, ShardedMuon

_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "fused"}


def param_groups_from(model_parameters: Any) -> list[dict]:
    """Normalise ``model_parameters`` (tensors or group dicts) into group dicts."""
    items = list(model_parameters)
    if not items:
        raise ConfigError("model_parameters", "no parameters to optimize")
    if all(isinstance(i, dict) for i in items):
        groups = [dict(g, params=[g["params"]] if isinstance(g["params"], torch.Tensor)
                       else list(g["params"])) for g in items]
    elif all(isinstance(i, torch.Tensor) for i in items):
        groups = [{"params": items}]
    else:
        raise ConfigError("model_parameters",
                          "expected an iterable of parameters or of parameter-group dicts")
    seen: set[int] = set()
    for group in groups:
        for p in group["params"]:
            if id(p) in seen:
                raise ConfigError("model_parameters", "a parameter appears in two groups")
            seen.add(id(p))
    return groups


def build_optimizer(type_name: str, params: dict, groups: Sequence[dict],
                    *, device: torch.device, host_step: bool = False) -> torch.optim.Optimizer:
    """Build DeepSpeed's ``optimizer`` section over ``groups`` (whose params are shards).

    As in DeepSpeed, ``Adam`` means AdamW (decoupled weight decay) unless
    ``adam_w_mode`` is false. ``host_step``: the shards are offloaded fp32 state stepped
    on the CPU, where torch's fused Adam is the fast path (no compiled ops of our own).
    """
    params = dict(params)
    fast = {"fused": True} if host_step else _fast_path(device)
    if type_name in ("Adam", "AdamW"):
        adam_w_mode = params.pop("adam_w_mode", True)
        for ignored in ("torch_adam", "bias_correction"):
            params.pop(ignored, None)
        kwargs = {k: v for k, v in params.items() if k in _ADAM_KEYS}
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        if "fused" not in kwargs and "foreach" not in kwargs:
            kwargs.update(fast)
        cls = torch.optim.AdamW if (type_name == "AdamW" or adam_w_mode) else torch.optim.Adam
        return cls(list(groups), **kwargs)
    if type_name == "Muon":   # groups split into halves by muon/groups.py
        return ShardedMuon(list(groups), adam_w_mode=params.get("adam_w_mode", True))
    if type_name == "SGD":
        if "lr" not in params:
            raise ConfigError("optimizer.params.lr", "SGD needs a learning rate")
        return torch.optim.SGD(list(groups), **params)
    raise ConfigError("optimizer.type", f"unsupported optimizer {type_name!r}")


def _fast_path(device: torch.device) -> dict:
    """torch's fused kernels are exact Adam and much faster; use them where they exist."""
    if device.type == "cuda":
        return {"fused": True}
    return {}


# Client optimizers whose update of each element depends only on that element's gradient
# and state, created at the first step: stepping one flat shard per group is the same
# arithmetic as stepping each parameter (Note: one flat tensor per group).
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax, torch.optim.Rprop)


def check_client_optimizer(optimizer: Any, *, allow_untested: bool) -> None:
    """Refuse a client optimizer that is not known to be elementwise (Adafactor's factored
    moments, LAMB's per-tensor trust ratio, Adagrad's state made at construction): on flat
    shards it would train differently without a word. ``zero_allow_untested_optimizer``
    (DeepSpeed's key) steps it anyway."""
    if allow_untested or isinstance(optimizer, ELEMENTWISE_OPTIMIZERS + MATRIX_OPTIMIZERS):
        return
    cls = type(optimizer)
    raise ConfigError(
        "optimizer", f"{cls.__module__}.{cls.__qualname__} is not one of the optimizers "
        "zerotrain knows to update each element on its own (torch's "
        + ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS) + "); it is stepped on flat "
        "shards of the parameters, where per-tensor statistics (factored moments, trust "
        "ratios, norms) would silently differ. Use one of those, or set "
        "\"zero_allow_untested_optimizer\": true to step it anyway (as in DeepSpeed)")


def retarget_optimizer(optimizer: torch.optim.Optimizer,
                       shard_groups: Sequence[list[torch.Tensor]]) -> torch.optim.Optimizer:
    """Point a client optimizer's groups at ``shard_groups`` (one list per group)."""
    if len(shard_groups) != len(optimizer.param_groups):
        raise ValueError("one shard list per optimizer group is required")
    if any(len(s) for s in optimizer.state.values()):
        raise ConfigError("optimizer", "the client optimizer already holds state (it has "
                          "stepped); pass a fresh optimizer to initialize")
    for group, shards in zip(optimizer.param_groups, shard_groups):
        group["params"] = list(shards)
    optimizer.state.clear()
    return optimizer


class ZeroOptimizer:
    """What ``initialize`` returns as the optimizer: the torch optimizer over the shards.

    ``param_groups`` are the inner optimizer's, so reading or setting ``lr`` works as with
    DeepSpeed. Stepping goes through ``engine.step()``, which reduces gradients first.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 deepspeed_kinds: frozenset[str] = frozenset(),
                 norm_groups: Optional[Callable[[], list]] = None,
                 last_norm: Optional[Callable[[], Optional[float]]] = None) -> None:
        self.optimizer = optimizer
        self.deepspeed_kinds = deepspeed_kinds   # optim/kinds.py: DeepSpeed's classes, isinstance
        self._norm_groups, self._last_norm = norm_groups, last_norm

    @property
    def _global_grad_norm(self) -> Optional[float]:
        """The last step's gradient norm (``engine.get_global_grad_norm()``), by DeepSpeed's
        private name, which its tests read."""
        return self._last_norm() if self._last_norm is not None else None

    def _get_norm_groups(self) -> list:
        """Each parameter group's gradient norm for this update (``utils``), by DeepSpeed's
        private name, which its gradient-clipping test reads. Collective at stages 1-3."""
        if self._norm_groups is None:
            raise StateError("_get_norm_groups: this optimizer is not an engine's")
        return self._norm_groups()

    # DeepSpeed's ZeRO optimizer attributes (engine/optimizer_views.py), once an engine
    # has bound its views (``views``); None for an optimizer no engine holds.
    views: Any = None

    def _view(self, name: str) -> Any:
        if self.views is None:
            raise StateError(f"{name}: this optimizer is not an engine's")
        return getattr(self.views, name)()

    @property
    def averaged_gradients(self) -> dict:
        """{group index: [this rank's chunk of each parameter's averaged gradient]}."""
        return self._view("averaged_gradients")

    @property
    def fp16_groups(self) -> list:
        return self._view("fp16_groups")

    @property
    def fp32_partitioned_groups_flat(self) -> list:
        """This rank's fp32 master shards (DeepSpeed's name at stage 3; the same list under
        its stage 1-2 name ``single_partition_of_fp32_groups`` and its fp16 optimizer's
        ``fp32_groups_flat``, which DeepSpeed's checkpoint tests compare after a load)."""
        return self._view("fp32_partitioned_groups_flat")

    single_partition_of_fp32_groups = fp32_partitioned_groups_flat
    fp32_groups_flat = fp32_partitioned_groups_flat

    @property
    def bit16_groups_flat(self) -> list:
        """Stages 1-2: each group's parameters, flat, in the training dtype (a copy)."""
        return self._view("bit16_groups_flat")

    @property
    def fp32_groups_gradients_flat(self) -> list:
        """Per group, the whole averaged gradient, flat (collective)."""
        return self._view("fp32_groups_gradients_flat")

    def needs_scaler(self) -> bool:
        """DeepSpeed's question before a direct ``loss.backward()``: does the loss need
        ``engine.scale(loss)`` (fp16's loss scaling)?"""
        return self._view("needs_scaler")

    @property
    def forward_hooks(self) -> list:
        return self._view("forward_hooks")

    @property
    def parameter_offload(self) -> Any:
        """Stage 3: DeepSpeed's hooks object (``engine/parameter_offload.py``), which TRL's
        and DeepSpeed's generation blocks take apart and put back. AttributeError
        otherwise, so ``hasattr`` answers as with DeepSpeed's stage 1-2 optimizer."""
        if self.views is None:
            raise AttributeError("parameter_offload: this optimizer is not an engine's")
        return self.views.parameter_offload()

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def micro_step_id(self) -> int:
        """Stage 3: backwards reduced into the partitioned gradients since the last update
        (DeepSpeed's counter; a ``coalesce_grad_reduction()`` block counts once)."""
        return self._view("micro_step_id")

    def get_fp32_grad_partitions(self) -> dict:
        """{group index: {parameter index: this rank's fp32 gradient chunk}} (DeepSpeed's)."""
        return self._view("get_fp32_grad_partitions")

    def step(self, closure=None) -> None:
        """The engine's update, as DeepSpeed's ZeRO optimizer steps (engine/optimizer_views.py,
        Note "optimizer.step() without engine.step()"); ``engine.step()`` does the same and
        also advances the LR scheduler and the step counters."""
        if closure is not None:
            raise StateError("optimizer.step(closure): a closure is not supported (as in "
                             "DeepSpeed); run engine.backward(loss) first")
        if self.views is None:
            raise StateError("the optimizer is stepped by engine.step(), which reduces the "
                             "gradients first; call engine.step() instead of optimizer.step()")
        self.views.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward starts the gradients afresh, as with DeepSpeed's ZeRO optimizer
        (a step before it still uses them); after an update there are none."""
        if self.views is not None:
            self.views.zero_grad()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"


class InferenceOnlyOptimizer(torch.optim.Optimizer):
    """The optimizer of an engine built with none (no ``optimizer`` section and no
    ``initialize(optimizer=...)``), as DeepSpeed allows for a reference or evaluation model:
    no parameter groups, and stepping it is an error naming why."""

    def __init__(self) -> None:
        super().__init__([{"params": []}], {})
        self.param_groups.clear()

    def step(self, closure: Any = None) -> None:
        raise StateError("this engine was built without an optimizer (no 'optimizer' "
                         "section in the config and no initialize(optimizer=...)), so it "
                         "runs forward only")
