"""What ``initialize`` does for Muon: refuse what it cannot run, tag, and bind the stage.

Why a module of its own: three small steps at three points of ``initialize``, kept out of
its set-up order so that the optimizer's needs stay beside the optimizer.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ..errors import ConfigError
from .groups import tag_model
from .sharded import MATRIX_OPTIMIZERS, ShardedMuon


def uses_muon(cfg: Any, client: Optional[Any]) -> bool:
    """The config's optimizer is Muon (no client), or the client is ``torch.optim.Muon``."""
    if client is not None:
        return isinstance(client, MATRIX_OPTIMIZERS)
    return cfg.optimizer is not None and cfg.optimizer.type == "Muon"


def check_and_tag(cfg: Any, client: Optional[Any], model: nn.Module) -> Optional[dict]:
    """Refuse the settings Muon cannot run with, each by name; tag the model's parameters
    for the config's Muon (``groups.tag_model``). Returns the config's Muon params (for the
    group split), or None when the groups are not to be split."""
    if not uses_muon(cfg, client):
        return None
    if cfg.tensor_parallel.size > 1:
        raise ConfigError("tensor_parallel.autotp_size", "Muon orthogonalises whole "
                          "matrices, and tensor parallelism cuts them across ranks; train "
                          "Muon without tensor parallelism", value=cfg.tensor_parallel.size)
    if cfg.bf16.bf16_master_weights_and_grads:
        raise ConfigError("bf16.bf16_master_weights_and_grads", "Muon keeps an fp32 momentum "
                          "beside fp32 masters; bf16 masters and moments are implemented for "
                          "Adam only; remove the key or use Adam", value=True)
    offload = cfg.zero_optimization.offload_optimizer
    if offload is not None and offload.device == "nvme":
        raise ConfigError("zero_optimization.offload_optimizer.device", "Muon's state is "
                          "not swapped to NVMe; use \"cpu\" or no optimizer offload",
                          value="nvme")
    for key in ("dpu", "speculative"):
        if offload is not None and getattr(offload, key, False):
            raise ConfigError(f"zero_optimization.offload_optimizer.{key}", "Muon exchanges "
                              "each matrix between ranks inside the step, which a step on a "
                              "worker thread cannot do; remove the key", value=True)
    if client is not None:
        return None
    tag_model(model)
    return dict(cfg.optimizer.params)


def bind(stage: Any, model: nn.Module) -> None:
    """Tell a Muon optimizer where its matrices sit in the stage's shards (collective-free;
    the same on every rank)."""
    if isinstance(stage.optimizer, ShardedMuon):
        stage.optimizer.bind(stage.shard_records(), stage.comm, dict(model.named_parameters()))
