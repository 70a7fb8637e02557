"""Pick the ZeRO stage (and offload) for a GPU size, and write its DeepSpeed config.

Note: the recommendation rule
    "Start with ZeRO-2": it shards gradients and optimizer state with the same traffic as
    plain data parallelism (2Ψ per step), while ZeRO-3 adds a parameter all-gather in
    backward (3Ψ) and offload adds PCIe or NVMe transfers. So, per GPU, counting model
    states + zerotrain's fp32 gradient accumulation + activations (when known) + ZeRO-3's
    gathered largest layer (when known):

    1. ZeRO-1 if that fits in half the GPU (ample room; with gradient accumulation it
       reduces once per step instead of every micro-step);
    2. else the first of ZeRO-2, ZeRO-3, ZeRO-3 + optimizer on CPU, ZeRO-3 + optimizer and
       parameters on CPU, ZeRO-3 + optimizer on NVMe and parameters on CPU (Adam only:
       NVMe swaps Adam state) that fits in 80% of the GPU (the other 20% is for
       communication buckets, temporaries, fragmentation and the CUDA context) and, with
       ``--cpu-memory``, whose host share fits in 80% of the node's memory. Offload keeps
       the gradient shard (and zerotrain's fp32 accumulation of it) on the GPU, so each
       offload step saves less GPU memory than DeepSpeed's layout would (states.py, Note
       "offload");
    3. for each of those, activation checkpointing is tried only after the plain run
       does not fit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .sizes import format_gb
from .states import BF16_STATES, Placement, StateEstimate, fp32_accumulation_extra

__all__ = ["AMPLE_FRACTION", "SAFE_FRACTION", "Budget", "Recommendation", "ds_config",
           "recommend"]

AMPLE_FRACTION = 0.5  # ZeRO-1 only with this much of the GPU left over
SAFE_FRACTION = 0.8   # everything else must fit in this fraction of GPU (and host) memory
_ORDER: tuple[Placement, ...] = (
    Placement(2), Placement(3), Placement(3, "cpu"), Placement(3, "cpu", "cpu"),
    Placement(3, "nvme", "cpu"))


@dataclass(frozen=True)
class Budget:
    """What a run must fit in, and what comes on top of the model states (bytes)."""

    gpu_memory: int
    cpu_memory: Optional[int] = None
    activations: Optional[float] = None           # None: unknown (no model shape)
    activations_checkpointed: Optional[float] = None
    live_layer: float = 0.0                       # ZeRO-3: the largest layer, gathered


@dataclass(frozen=True)
class Recommendation:
    """The chosen placement (None when nothing fits) and how it was judged."""

    placement: Optional[Placement]
    gpu_bytes: float = 0.0
    checkpointing: bool = False
    parts: dict[str, float] = field(default_factory=dict)
    reason: str = ""


def _gpu_need(row: StateEstimate, *, total_params: int, world: int, dtype: str,
              budget: Budget, checkpointing: bool, tp: int = 1,
              split_params: Optional[int] = None, optimizer: str = "adam") -> dict[str, float]:
    parts = {"model states": row.gpu_total,
             "fp32 gradient accumulation": fp32_accumulation_extra(
                 total_params, row.placement, world=world, dtype=dtype, tp=tp,
                 split_params=split_params, optimizer=optimizer)}
    act = budget.activations_checkpointed if checkpointing else budget.activations
    if act is not None:
        parts["activations" + (" (checkpointed)" if checkpointing else "")] = act
    if row.placement.stage == 3 and budget.live_layer:
        parts["gathered largest layer"] = budget.live_layer
    return {name: value for name, value in parts.items() if value}


def recommend(rows: list[StateEstimate], budget: Budget, *, total_params: int, world: int,
              dtype: str, tp: int = 1, split_params: Optional[int] = None,
              optimizer: str = "adam") -> Recommendation:
    """Apply Note "the recommendation rule" to the rows of ``model_states`` (a placement
    without a row, such as NVMe for SGD, is skipped)."""
    by_placement = {row.placement: row for row in rows}
    gpu = budget.gpu_memory
    candidates: list[tuple[Placement, bool, float]] = [(Placement(1), False, AMPLE_FRACTION)]
    modes = (False, True) if budget.activations_checkpointed is not None else (False,)
    candidates += [(p, ckpt, SAFE_FRACTION) for p in _ORDER for ckpt in modes]
    for placement, ckpt, fraction in candidates:
        row = by_placement.get(placement)
        if row is None:
            continue
        parts = _gpu_need(row, total_params=total_params, world=world, dtype=dtype,
                          budget=budget, checkpointing=ckpt, tp=tp,
                          split_params=split_params, optimizer=optimizer)
        need = sum(parts.values())
        host_ok = (budget.cpu_memory is None
                   or row.host_per_node <= SAFE_FRACTION * budget.cpu_memory)
        if need <= fraction * gpu and host_ok:
            room = "half" if fraction == AMPLE_FRACTION else f"{SAFE_FRACTION:.0%}"
            reason = (f"{placement.label}: {format_gb(need)} GB of {format_gb(gpu)} GB per "
                      f"GPU fits within {room} of it")
            if placement.offloaded:
                reason += f", with {format_gb(row.host_per_node)} GB per node on CPU"
                if row.nvme_per_node:
                    reason += f" and {format_gb(row.nvme_per_node)} GB on NVMe"
            return Recommendation(placement, need, ckpt, parts, reason)
    return Recommendation(None, reason=(
        f"nothing fits in {SAFE_FRACTION:.0%} of {format_gb(gpu)} GB per GPU"
        + ("" if budget.cpu_memory is None else
           f" and {SAFE_FRACTION:.0%} of {format_gb(budget.cpu_memory)} GB per node")
        + ": add GPUs or nodes (ZeRO-3 divides the model states by their number)"))


def _offload(device: str) -> dict:
    section: dict = {"device": device, "pin_memory": True}
    if device == "nvme":
        section["nvme_path"] = "/local_nvme"  # edit: a directory on a fast local NVMe drive
    return section


def ds_config(placement: Placement, *, dtype: str, optimizer: str,
              micro_batch: int = 1) -> dict:
    """A DeepSpeed/zerotrain JSON config (as a dict) for ``placement``.

    Learning rates and batch sizes are starting points to edit; the ZeRO section is the
    point. Bucket sizes are DeepSpeed's defaults (5e8 elements).
    """
    config: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": ({"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                                   "weight_decay": 0.1}}
                      if optimizer in ("adam", "adam-bf16") else
                      {"type": "Muon", "params": {"lr": 3e-4, "muon_lr": 0.02,
                                                  "weight_decay": 0.1}}
                      if optimizer == "muon" else
                      {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}}),
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
        if optimizer == BF16_STATES:
            config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    zero: dict = {"stage": placement.stage, "overlap_comm": True,
                  "contiguous_gradients": True, "reduce_bucket_size": 500_000_000,
                  "allgather_bucket_size": 500_000_000}
    if placement.stage == 3:
        zero["stage3_prefetch_bucket_size"] = 50_000_000
        zero["stage3_param_persistence_threshold"] = 100_000
    if placement.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(placement.offload_optimizer)
    if placement.offload_param != "none":
        zero["offload_param"] = _offload(placement.offload_param)
    config["zero_optimization"] = zero
    return config
