"""Per-GPU memory of the model states (parameters, gradients, optimizer state) under ZeRO.

Note: the ZeRO table
    With Ψ parameters on N data-parallel GPUs, mixed precision (bf16/fp16) and Adam, each
    parameter costs 2 bytes of 16-bit weight, 2 bytes of 16-bit gradient and K = 12 bytes of
    optimizer state (fp32 master copy, momentum, variance): 16Ψ per GPU for plain data
    parallelism. ZeRO shards what it can over the N GPUs:

        stage 0 (data parallel)  2Ψ   + 2Ψ   + 12Ψ   = 16Ψ
        ZeRO-1 (optimizer)       2Ψ   + 2Ψ   + 12Ψ/N = 4Ψ + 12Ψ/N
        ZeRO-2 (+ gradients)     2Ψ   + 2Ψ/N + 12Ψ/N = 2Ψ + 14Ψ/N
        ZeRO-3 (+ parameters)    2Ψ/N + 2Ψ/N + 12Ψ/N = 16Ψ/N

    7B parameters on 8 GPUs: 112, 38.5, 26.25 and 14 GB (decimal GB, as the ZeRO paper).
    fp32 training keeps 4Ψ weights, 4Ψ gradients and only the moments (8Ψ for Adam): the
    weights are the master copy. SGD with momentum keeps 4Ψ of momentum instead of Adam's
    8Ψ, plus the 4Ψ master copy in mixed precision.

Note: offload
    zerotrain's offload (``zerotrain.offload``), not DeepSpeed's layout. With
    ``offload_optimizer`` (stages 1-3) each rank's fp32 master shard and optimizer moments
    live off the GPU and the host steps them: 4 + 8 = 12 bytes per parameter of the shard
    with Adam, 4 + 4 with SGD momentum, in every training dtype (in fp32 training the host
    master is a copy of the 4-byte weights, since the GPU keeps its own). There is no host
    fp32 gradient copy: the reduced gradient shard stays on the GPU until the step (so
    zerotrain's fp32 accumulation still applies) and goes to the host one bucket at a time
    through bounded staging buffers. On the GPU, in mixed precision:

        ZeRO-1 + optimizer offload   2Ψ   + 2Ψ   = 4Ψ
        ZeRO-2 + optimizer offload   2Ψ   + 2Ψ/N = 2Ψ + 2Ψ/N
        ZeRO-3 + optimizer offload   2Ψ/N + 2Ψ/N = 4Ψ/N
        ZeRO-3 + parameters too             2Ψ/N          (plus the gathered live layers)

    ``offload_param`` (stage 3) moves the parameter shard to the host, 2 bytes per parameter
    / N more there (4 in fp32); with its device "nvme" those bytes are files read through the
    page cache at each gather instead (no row: the table keeps the faster host placement). With
    ``offload_optimizer.device "nvme"`` the 12 bytes go to files and the host keeps only a
    few swap slots of the largest bucket (not counted), so the NVMe row puts the optimizer
    state on NVMe and the parameter shards on the host; NVMe swaps Adam/AdamW state only, so
    there is no NVMe row for SGD. The delayed parameter update (``offload_optimizer.dpu``)
    also keeps an fp32 gradient shard on the host: 4 bytes per parameter / N more. Off-GPU
    figures are per node: the node's GPUs each hold 1/N of the states. DeepSpeed lays
    offload out differently (16 or 18 bytes per parameter on the host, its estimator in
    :mod:`~zerotrain.estimate.deepspeed_api`).

Note: tensor parallelism
    With ``tensor_parallel.autotp_size`` T (docs/tensor-parallel.md, "Memory per rank") a
    rank holds Ψ_T = Ψ_s/T + Ψ_r parameter elements, Ψ_s in split layers and Ψ_r replicated
    (embeddings, norms, ``lm_head``), and ZeRO shards over the D = N/T data-parallel ranks.
    Every row then holds with Ψ -> Ψ_T and N -> D. At stage 3 that is Ψ_s/(T·D) + Ψ_r/D
    for the sharded states (stage 3 partitions each rank's slices over its D data-parallel
    ranks, ``tp/zero3.py``). Without a model, Ψ_r is taken as 0 (Ψ_T = Ψ/T).

Activations, communication buckets, ZeRO-3's gathered live layers and the allocator's
fragmentation all come on top of these numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

__all__ = ["BytesPerParam", "DTYPES", "OPTIMIZERS", "PLACEMENTS", "Placement",
           "StateEstimate", "fp32_accumulation_extra", "gpu_shares", "model_states",
           "off_gpu_shares", "per_rank_params"]

Precision = Literal["bf16", "fp16", "fp32"]
OptimizerName = Literal["adam", "adam-bf16", "sgd", "muon"]
Device = Literal["none", "cpu", "nvme"]
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
OPTIMIZERS: tuple[str, ...] = ("adam", "adam-bf16", "sgd", "muon")
# fp32 momentum + variance; fp32 momentum; Muon's fp32 momentum of the matrices it steps
# (the parameters its AdamW half steps keep Adam's 8: the traced peak counts both)
_MOMENT_BYTES = {"adam": 8, "sgd": 4, "muon": 4}
# "adam-bf16": Adam with bf16.bf16_master_weights_and_grads and bf16_optimizer_states, whose
# master (2) and moments (2 + 2) are bf16 and whose gradients are accumulated in bf16
BF16_STATES = "adam-bf16"
_DEVICE_NAMES = {"cpu": "CPU", "nvme": "NVMe"}


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of each model state before sharding (Note "the ZeRO table")."""

    params: int
    grads: int
    optimizer: int       # on the GPU: moments, plus the fp32 master copy in mixed precision
    host_optimizer: int  # offloaded: fp32 master + moments, in any dtype (Note "offload")

    @classmethod
    def of(cls, dtype: str, optimizer: str) -> "BytesPerParam":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, "
                             f"got {optimizer!r}")
        if optimizer == BF16_STATES:
            if dtype != "bf16":
                raise ValueError(f"optimizer {BF16_STATES} keeps bf16 masters beside bf16 "
                                 f"parameters; it needs dtype bf16, got {dtype!r}")
            return cls(params=2, grads=2, optimizer=6, host_optimizer=6)
        moments = _MOMENT_BYTES[optimizer]
        if dtype == "fp32":
            return cls(params=4, grads=4, optimizer=moments, host_optimizer=4 + moments)
        return cls(params=2, grads=2, optimizer=4 + moments, host_optimizer=4 + moments)


@dataclass(frozen=True)
class Placement:
    """A way to run: a ZeRO stage and where the optimizer state and parameters live."""

    stage: int
    offload_optimizer: Device = "none"
    offload_param: Device = "none"

    @property
    def label(self) -> str:
        name = "data parallel (stage 0)" if self.stage == 0 else f"ZeRO-{self.stage}"
        opt, par = self.offload_optimizer, self.offload_param
        if opt != "none" and opt == par:
            return f"{name}, optimizer+params on {_DEVICE_NAMES[opt]}"
        if opt != "none" and par != "none":
            return f"{name}, optimizer on {_DEVICE_NAMES[opt]}, params on {_DEVICE_NAMES[par]}"
        if par != "none":
            return f"{name}, params on {_DEVICE_NAMES[par]}"
        if opt != "none":
            return f"{name}, optimizer on {_DEVICE_NAMES[opt]}"
        return name

    @property
    def offloaded(self) -> bool:
        return self.offload_optimizer != "none"


# The table's rows, in order of increasing savings (and cost). zerotrain puts parameters on
# the host only, so the NVMe row keeps the optimizer state on NVMe and the params on the CPU.
PLACEMENTS: tuple[Placement, ...] = (
    Placement(0), Placement(1), Placement(2), Placement(3),
    Placement(2, "cpu"), Placement(3, "cpu"), Placement(3, "cpu", "cpu"),
    Placement(3, "nvme", "cpu"),
)


@dataclass(frozen=True)
class StateEstimate:
    """Bytes of model states for one placement: per GPU by category, and per node off-GPU."""

    placement: Placement
    gpu_params: float
    gpu_grads: float
    gpu_optimizer: float
    host_per_node: float
    nvme_per_node: float
    formula: str  # per-GPU total in Ψ and N, e.g. "2Ψ + 14Ψ/N"

    @property
    def gpu_total(self) -> float:
        return self.gpu_params + self.gpu_grads + self.gpu_optimizer


def gpu_shares(placement: Placement, bpp: BytesPerParam) -> dict[str, tuple[int, bool]]:
    """Per category: (bytes per parameter on the GPU, whether sharded over the N GPUs).

    Offloading keeps the gradients on the GPU (Note "offload"): only the optimizer state
    and, with ``offload_param``, the parameter shard leave it."""
    stage = placement.stage
    return {
        "params": (0 if placement.offload_param != "none" else bpp.params, stage >= 3),
        "grads": (bpp.grads, stage >= 2),
        "optimizer": (0 if placement.offloaded else bpp.optimizer, stage >= 1),
    }


def off_gpu_shares(placement: Placement, bpp: BytesPerParam) -> dict[str, int]:
    """Bytes per parameter of the rank's shard held on the host and on NVMe (Note
    "offload"); swap slots and staging buffers are bounded and not counted."""
    optimizer = bpp.host_optimizer if placement.offloaded else 0
    params = bpp.params if placement.offload_param != "none" else 0
    on_nvme = placement.offload_optimizer == "nvme"
    return {"host": params + (0 if on_nvme else optimizer),
            "nvme": optimizer if on_nvme else 0}


def _formula(shares: dict[str, tuple[int, bool]], tp: int = 1) -> str:
    full = sum(b for b, sharded in shares.values() if not sharded)
    split = sum(b for b, sharded in shares.values() if sharded)
    psi, n = ("Ψ_T", "D") if tp > 1 else ("Ψ", "N")
    terms = ([f"{full}{psi}"] if full else []) + ([f"{split}{psi}/{n}"] if split else [])
    return " + ".join(terms) or "0"


def per_rank_params(total_params: int, *, tp: int = 1,
                    split_params: Optional[int] = None) -> float:
    """Ψ_T = Ψ_s/T + Ψ_r, the parameter elements one rank of a tensor-parallel group holds
    (Note "tensor parallelism"); ``split_params`` None counts every parameter as split."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {tp}")
    split = total_params if split_params is None else split_params
    if not 0 <= split <= total_params:
        raise ValueError(f"split parameters {split} must lie in 0..{total_params}")
    return split / tp + (total_params - split)


def _data_parallel(world: int, tp: int) -> int:
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {tp}")
    if world % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the {world} GPUs")
    return world // tp


def model_states(total_params: int, *, gpus_per_node: int, nodes: int = 1,
                 dtype: str = "bf16", optimizer: str = "adam", tp: int = 1,
                 split_params: Optional[int] = None) -> list[StateEstimate]:
    """Model-state bytes for every row of :data:`PLACEMENTS` (Notes "the ZeRO table",
    "offload"; the NVMe row only with Adam). Gradients are counted in the training dtype, as in the ZeRO paper; see
    :func:`fp32_accumulation_extra` for zerotrain's fp32 accumulation default. With ``tp``
    T > 1, per rank of a T-way tensor-parallel group (Note "tensor parallelism");
    ``split_params`` is Ψ_s (None: all of Ψ)."""
    if total_params < 1 or gpus_per_node < 1 or nodes < 1:
        raise ValueError("total_params, gpus_per_node and nodes must all be >= 1")
    bpp = BytesPerParam.of(dtype, optimizer)
    dp = _data_parallel(gpus_per_node * nodes, tp)
    elements = per_rank_params(total_params, tp=tp, split_params=split_params)
    rows = []
    for placement in PLACEMENTS:
        if placement.offload_optimizer == "nvme" and optimizer != "adam":
            continue  # NVMe swaps fp32 Adam/AdamW state only (Note "offload")
        if placement.stage == 0 and optimizer == BF16_STATES:
            continue  # bf16 masters need ZeRO stage 1-3 (DeepSpeed asserts it)
        shares = gpu_shares(placement, bpp)
        gpu = {name: elements * b / (dp if sharded else 1)
               for name, (b, sharded) in shares.items()}
        per_node = {name: elements * b / dp * gpus_per_node
                    for name, b in off_gpu_shares(placement, bpp).items()}
        rows.append(StateEstimate(
            placement=placement, gpu_params=gpu["params"], gpu_grads=gpu["grads"],
            gpu_optimizer=gpu["optimizer"], host_per_node=per_node["host"],
            nvme_per_node=per_node["nvme"], formula=_formula(shares, tp)))
    return rows


def fp32_accumulation_extra(total_params: int, placement: Placement, *, world: int,
                            dtype: str, tp: int = 1,
                            split_params: Optional[int] = None,
                            optimizer: str = "adam") -> float:
    """Bytes per GPU that zerotrain's default fp32 gradient accumulation adds to the table.

    ``data_types.grad_accum_dtype`` defaults to fp32, so a 16-bit run keeps 4-byte instead
    of 2-byte gradients: +2Ψ at stages 0-1 (full gradients), +2Ψ/N at stages 2-3 (a shard).
    Offload changes nothing here: the gradients stay on the GPU until the step (Note
    "offload"). Nothing is added for fp32 training, nor with bf16 masters (``adam-bf16``),
    whose gradients are bf16.
    """
    if dtype == "fp32" or optimizer == BF16_STATES:
        return 0.0
    elements = per_rank_params(total_params, tp=tp, split_params=split_params)
    return 2.0 * elements / (_data_parallel(world, tp) if placement.stage >= 2 else 1)
