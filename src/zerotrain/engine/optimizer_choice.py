"""The optimizer and LR scheduler a stage gets: the client's, or the config's.

Why a module of its own: ``initialize`` accepts DeepSpeed's three sources (a client
optimizer, ``model_parameters`` groups, the config's ``optimizer`` section) and a scheduler
object, a callable or the config's ``scheduler``; turning them into parameter groups and
into the factory the stage calls over its flat shards is one job, apart from the set-up
order ``initialize`` writes down.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..config import ZeroTrainConfig
from ..errors import AssertedConfigError, ConfigError
from ..moe.utils import configure_moe_param_groups, has_moe_layers
from ..ops.adam import DeepSpeedCPUAdam
from ..muon import ShardedMuon, muon_param_groups
from ..muon.sharded import MATRIX_OPTIMIZERS
from ..optim import (InferenceOnlyOptimizer, build_optimizer, param_groups_from,
                     retarget_optimizer)
from ..schedules import build_scheduler


def trainable_groups(model: nn.Module, optimizer, model_parameters,
                     muon: dict | None = None) -> list[dict]:
    """Parameter groups (dicts) of trainable module parameters, in a fixed order.
    ``muon``: the config's Muon ``optimizer.params`` (each group split into halves)."""
    if optimizer is not None:
        groups = [dict(g, params=list(g["params"])) for g in optimizer.param_groups]
    elif model_parameters is not None:
        groups = param_groups_from(model_parameters)
    else:
        groups = [{"params": list(model.parameters())}]
    if optimizer is None and muon is not None:   # DeepSpeed's halves (muon/groups.py)
        groups = muon_param_groups(groups, muon,
                                   {id(p): n for n, p in model.named_parameters()})
    if optimizer is None and has_moe_layers(model)[0]:   # DeepSpeed's expert groups
        plain = len(groups) == 1 and groups[0].keys() == {"params"}
        groups = configure_moe_param_groups(groups[0]["params"] if plain else groups)
    owned = {id(p) for p in model.parameters()}
    for g in groups:
        for p in g["params"]:
            if id(p) not in owned:
                raise ConfigError("model_parameters", f"a parameter of shape {tuple(p.shape)} "
                                  "is not a parameter of the model")
        g["params"] = [p for p in g["params"] if p.requires_grad]
    if not any(g["params"] for g in groups):
        raise ConfigError("model_parameters", "the model has no trainable parameters")
    return groups


def refuse_offloaded_client_optimizer(cfg: ZeroTrainConfig, client) -> None:
    """DeepSpeed's ``zero_force_ds_cpu_optimizer`` (on by default): with the optimizer
    offloaded (``offload_optimizer.device`` cpu or nvme), a client optimizer must be a
    ``DeepSpeedCPUAdam``, the host optimizer both provide; any other is refused unless the
    key is false, as DeepSpeed refuses it. zerotrain could step it on the host as it is; it
    refuses so that a config that runs here runs under DeepSpeed too."""
    offload = cfg.zero_optimization.offload_optimizer
    if (client is None or not cfg.zero_force_ds_cpu_optimizer or offload is None
            or offload.device not in ("cpu", "nvme") or isinstance(client, DeepSpeedCPUAdam)):
        return
    cls = type(client)
    raise ConfigError(
        "zero_force_ds_cpu_optimizer", f"the optimizer is offloaded (zero_optimization."
        f"offload_optimizer.device {offload.device!r}) and the client optimizer "
        f"{cls.__module__}.{cls.__qualname__} is not DeepSpeedCPUAdam; DeepSpeed refuses this "
        "too. Pass deepspeed.ops.adam.DeepSpeedCPUAdam (zerotrain.ops.adam), put the "
        "optimizer in the config's optimizer section, or set \"zero_force_ds_cpu_optimizer\": "
        "false to step this one on the host", value=True)


def refuse_fp32_cpu_adam_states(cfg: ZeroTrainConfig, client) -> None:
    """DeepSpeed's assert: with ``bf16.bf16_optimizer_states`` and the optimizer offloaded,
    a client ``DeepSpeedCPUAdam`` must be built with ``fp32_optimizer_states=False``, so
    that its moments are the bf16 ones the key asks for (DeepSpeed sets it so itself for
    the config's optimizer, as zerotrain's does)."""
    offload = cfg.zero_optimization.offload_optimizer
    if (not cfg.bf16.bf16_optimizer_states or not isinstance(client, DeepSpeedCPUAdam)
            or offload is None or offload.device == "none"
            or not getattr(client, "fp32_optimizer_states", True)):
        return
    raise AssertedConfigError(
        "bf16.bf16_optimizer_states", "bf16_optimizer_states with ZeRO-Offload requires "
        "DeepSpeedCPUAdam constructed with fp32_optimizer_states=False so optimizer moments "
        "are stored in bf16", value=True)


def optimizer_factory(cfg: ZeroTrainConfig, client: Optional[torch.optim.Optimizer],
                      groups: list[dict], device: torch.device
                      ) -> Callable[..., torch.optim.Optimizer]:
    """How the stage builds its optimizer over its shards: the client's, retargeted, or the
    config's ``optimizer`` section's (checked present when there is no client)."""
    optimizer = cfg.optimizer

    def make(shards: list[list[torch.Tensor]], *, host_step: bool) -> torch.optim.Optimizer:
        """One list of flat shard tensors per parameter group; ``host_step``: the stage's
        storage steps them on the host (the factory asks it, ``Storage.steps_on_host``)."""
        if client is not None:
            retargeted = retarget_optimizer(client, shards)
            return (ShardedMuon.around(retargeted) if isinstance(client, MATRIX_OPTIMIZERS)
                    else retargeted)
        assert optimizer is not None, "built only with a client or an optimizer section"
        shard_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": s}
                        for g, s in zip(groups, shards)]
        return build_optimizer(optimizer.type, optimizer.params, shard_groups,
                               device=torch.device("cpu") if host_step else device,
                               host_step=host_step)
    return make


def no_optimizer(shards: list[list[torch.Tensor]], *, host_step: bool
                  ) -> torch.optim.Optimizer:
    """The stage's optimizer for an engine built without one (forward only): no groups."""
    return InferenceOnlyOptimizer()


def scheduler_for(cfg: ZeroTrainConfig, client, optimizer: torch.optim.Optimizer):
    if cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler.type, cfg.scheduler.params, optimizer)
    if client is not None and not hasattr(client, "step") and callable(client):
        return client(optimizer)
    return client
