"""One estimate, end to end: the request, the table of rows, activations, the recommendation,
and its text rendering (returned as a string; the CLI prints it)."""
from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from typing import Optional

from .models import ModelShape, activation_bytes
from .plan import SAFE_FRACTION, Budget, Recommendation, ds_config, recommend
from .sizes import format_count, format_gb
from .states import (BytesPerParam, StateEstimate, fp32_accumulation_extra, model_states,
                     per_rank_params)

__all__ = ["EstimateReport", "EstimateRequest", "estimate"]

_PRECISION_NAMES = {"bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision",
                    "fp32": "fp32"}
_OPTIMIZER_NAMES = {"adam": "Adam", "sgd": "SGD with momentum",
                    "muon": "Muon (its AdamW half, embeddings and vectors, keeps Adam's "
                            "8 bytes: trace a step with --stage to count both)",
                    "adam-bf16": "Adam with bf16 master weights, gradients and moments "
                                 "(bf16.bf16_master_weights_and_grads, bf16_optimizer_states)"}
_WIDTH = 96  # notes are wrapped to this many columns


@dataclass(frozen=True)
class EstimateRequest:
    """What to estimate; ``shape`` (from ``--model``) adds the activation estimate."""

    total_params: int
    gpus_per_node: int = 1
    nodes: int = 1
    dtype: str = "bf16"
    optimizer: str = "adam"
    shape: Optional[ModelShape] = None
    micro_batch: Optional[int] = None
    seq_len: Optional[int] = None
    gpu_memory: Optional[int] = None
    cpu_memory: Optional[int] = None
    tp: int = 1                          # tensor_parallel.autotp_size T
    split_params: Optional[int] = None   # Ψ_s, from the AutoTP rules (None: all of Ψ)
    sp: int = 1                          # sequence_parallel_size S (Ulysses)
    tiled_mlp: bool = False              # TiledMLP in every layer
    loss_tiles: int = 1                  # TiledFusedLogitsLoss tiles (1: untiled)

    @property
    def activation_options(self) -> dict:
        """The keyword arguments of ``activation_bytes`` this request sets."""
        return {"tp": self.tp, "sp": self.sp, "tiled_mlp": self.tiled_mlp,
                "loss_tiles": self.loss_tiles}

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def per_rank_params(self) -> float:
        return per_rank_params(self.total_params, tp=self.tp, split_params=self.split_params)


@dataclass(frozen=True)
class EstimateReport:
    request: EstimateRequest
    rows: list[StateEstimate]
    activations: Optional[tuple[float, float]]  # (plain, fully checkpointed) bytes per GPU
    live_layer: float
    recommendation: Optional[Recommendation]
    config: Optional[dict]

    def render(self) -> str:
        return "\n".join(_header(self) + [""] + _table(self) + [""] + _notes(self)
                         + _recommendation_lines(self))


def estimate(request: EstimateRequest) -> EstimateReport:
    """Compute every row, the activations (when the shape is known) and, with a GPU memory
    size, the recommendation of :mod:`zerotrain.estimate.plan`."""
    r = request
    rows = model_states(r.total_params, gpus_per_node=r.gpus_per_node, nodes=r.nodes,
                        dtype=r.dtype, optimizer=r.optimizer, tp=r.tp,
                        split_params=r.split_params)
    activations = None
    if r.shape is not None and r.shape.has_transformer_shape and r.micro_batch and r.seq_len:
        activations = tuple(activation_bytes(r.shape, micro_batch=r.micro_batch,
                                             seq_len=r.seq_len, dtype=r.dtype,
                                             checkpointing=ckpt, **r.activation_options)
                            for ckpt in (False, True))
    bpp = BytesPerParam.of(r.dtype, r.optimizer)
    live = float((bpp.params + bpp.grads) * r.shape.largest_layer_params) if r.shape else 0.0
    rec, config = None, None
    if r.gpu_memory:
        budget = Budget(r.gpu_memory, r.cpu_memory,
                        activations[0] if activations else None,
                        activations[1] if activations else None, live)
        rec = recommend(rows, budget, total_params=r.total_params, world=r.world,
                        dtype=r.dtype, tp=r.tp, split_params=r.split_params,
                        optimizer=r.optimizer)
        if rec.placement is not None:
            config = ds_config(rec.placement, dtype=r.dtype, optimizer=r.optimizer,
                               micro_batch=r.micro_batch or 1)
            if r.tp > 1:
                config["tensor_parallel"] = {"autotp_size": r.tp}
            if r.sp > 1:
                config["sequence_parallel_size"] = r.sp
    return EstimateReport(r, rows, activations, live, rec, config)


def _header(rep: EstimateReport) -> list[str]:
    r = rep.request
    nodes = f"{r.nodes} node{'s' if r.nodes > 1 else ''} x {r.gpus_per_node} GPUs"
    lines = [f"Model states per GPU for {format_count(r.total_params)} parameters on "
             f"{r.world} GPUs ({nodes}), {_PRECISION_NAMES[r.dtype]}, "
             f"{_OPTIMIZER_NAMES[r.optimizer]}.",
             f"GB = 10^9 bytes; Ψ = {r.total_params:,} parameters, N = {r.world} GPUs."]
    if r.tp > 1:
        split = r.total_params if r.split_params is None else r.split_params
        source = ("all of Ψ counted as split: pass --model for the AutoTP rules' split"
                  if r.split_params is None else "split by the AutoTP rules")
        lines.append(f"Tensor parallel T = {r.tp}: Ψ_s = {split:,} ({source}), Ψ_T = Ψ_s/T + "
                     f"Ψ_r = {round(r.per_rank_params):,} per rank, D = N/T = "
                     f"{r.world // r.tp} data-parallel ranks.")
    if r.shape is not None and r.shape.description:
        lines.append(f"Model: {r.shape.description}; largest layer "
                     f"{format_count(r.shape.largest_layer_params)} parameters.")
    return lines


def _cell(nbytes: float) -> str:
    return format_gb(nbytes) if nbytes else "-"


def _need(rep: EstimateReport, row: StateEstimate) -> float:
    r = rep.request
    need = row.gpu_total + fp32_accumulation_extra(r.total_params, row.placement,
                                                   world=r.world, dtype=r.dtype, tp=r.tp,
                                                   split_params=r.split_params,
                                                   optimizer=r.optimizer)
    if rep.activations:
        need += rep.activations[0]
    return need + (rep.live_layer if row.placement.stage == 3 else 0.0)


def _table(rep: EstimateReport) -> list[str]:
    r = rep.request
    with_need = bool(r.gpu_memory or rep.activations)
    with_nvme = any(row.nvme_per_node for row in rep.rows)
    head = (["configuration", "params", "grads", "optimizer", "per GPU", "formula", "host/node"]
            + (["NVMe/node"] if with_nvme else []))
    if with_need:
        head += ["need*"] + ([f"fits {format_gb(r.gpu_memory)}GB"] if r.gpu_memory else [])
    body = []
    for row in rep.rows:
        cells = [row.placement.label, _cell(row.gpu_params), _cell(row.gpu_grads),
                 _cell(row.gpu_optimizer), format_gb(row.gpu_total), row.formula,
                 _cell(row.host_per_node)] + ([_cell(row.nvme_per_node)] if with_nvme else [])
        if with_need:
            need = _need(rep, row)
            cells.append(format_gb(need))
            if r.gpu_memory:
                cells.append("yes" if need <= SAFE_FRACTION * r.gpu_memory
                             else "tight" if need <= r.gpu_memory else "no")
        body.append(cells)
    widths = [max(len(line[i]) for line in [head] + body) for i in range(len(head))]
    left = {0, 5}  # text columns
    return ["  ".join(c.ljust(w) if i in left else c.rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths))).rstrip()
            for line in [head] + body]


def _notes(rep: EstimateReport) -> list[str]:
    r = rep.request
    notes = ["Activations, temporary buffers and the CUDA context come on top of these "
             "model states."]
    if rep.activations:
        plain, ckpt = rep.activations
        fused = activation_bytes(r.shape, micro_batch=r.micro_batch, seq_len=r.seq_len,
                                 dtype=r.dtype, checkpointing=False, fused_attention=True,
                                 **r.activation_options)
        notes.append(f"Activations per GPU (micro-batch {r.micro_batch} x {r.seq_len} tokens, "
                     f"Korthikanti et al. 2022): {format_gb(plain)} GB, or {format_gb(ckpt)} GB "
                     "with full activation checkpointing; need* uses the first. A fused "
                     "attention kernel (FlashAttention, SDPA) drops the 5as/h score term: "
                     f"{format_gb(fused)} GB.")
    else:
        notes.append("For an activation estimate pass --model with --micro-batch and "
                     "--seq-len.")
    if r.sp > 1 or r.tiled_mlp or r.loss_tiles > 1:
        tiled = [name for name, on in (("tiled MLP", r.tiled_mlp),
                                       (f"tiled loss over {r.loss_tiles} tiles",
                                        r.loss_tiles > 1)) if on]
        notes.append(
            (f"Sequence parallel S = {r.sp} (docs/sequence-parallel.md): each rank holds "
             f"seq_len / {r.sp} tokens of every activation, plus the all-to-all's send and "
             "receive copies of q, k and v for one layer; the model states are the same "
             "(ZeRO shards them over all ranks)." if r.sp > 1 else "")
            + (" " if r.sp > 1 and tiled else "")
            + (f"With {' and '.join(tiled)}: the MLP keeps only its input, the loss one "
               "tile of the logits." if tiled else ""))
    if r.tp > 1:
        notes.append(f"Tensor parallel T = {r.tp} (docs/tensor-parallel.md): each row holds "
                     "with Ψ -> Ψ_T and N -> D; activations inside the split layers are "
                     "divided by T. At ZeRO-3 the parameters, gradients and optimizer "
                     "state are / (T·D) for split parts and / D for replicated ones; "
                     "hpZ, MiCS, quantized weights or gradients and frozen parameters are "
                     "refused with tensor parallelism at stage 3.")
    if r.dtype != "fp32" and r.optimizer != "adam-bf16":
        extra_full = 2 * r.per_rank_params
        notes.append(
            "Gradients are counted in 16 bits, as in the ZeRO paper. zerotrain accumulates "
            "them in fp32 by default (data_types.grad_accum_dtype): "
            f"+{format_gb(extra_full)} GB per GPU at stages 0-1, "
            f"+{format_gb(extra_full / (r.world // r.tp))} GB at stages 2-3; "
            f'"data_types": {{"grad_accum_dtype": "{r.dtype}"}} matches the table.')
    bpp = BytesPerParam.of(r.dtype, r.optimizer)
    notes.append("ZeRO-3 also holds the layers in use, gathered whole: at least the largest "
                 f"layer's weights and gradients ({bpp.params + bpp.grads} bytes per parameter"
                 + (f", {format_gb(rep.live_layer)} GB here" if rep.live_layer else "") + ").")
    dpu_per_node = 4 * r.per_rank_params / (r.world // r.tp) * r.gpus_per_node
    notes.append(
        f"Offloaded rows: the {'bf16' if r.optimizer == 'adam-bf16' else 'fp32'} master and "
        f"optimizer moments ({bpp.host_optimizer} bytes per "
        "parameter) leave the GPU, for the host or, with NVMe, for files (the host then keeps "
        'a few bounded swap slots); "params on CPU" moves the parameter shard '
        f"({bpp.params} bytes per parameter) to the host too. Gradients stay on the GPU until "
        "the step and go to the host a bucket at a time"
        + (", so the fp32 accumulation above still applies"
           if r.dtype != "fp32" and r.optimizer != "adam-bf16" else "")
        + ". Host and NVMe figures are per node. offload_optimizer.dpu (delayed update) "
        f"adds an fp32 gradient shard on the host: +{format_gb(dpu_per_node)} GB per node. "
        "DeepSpeed lays offload out differently; its own estimator is "
        "zerotrain.estimate.estimate_zero3_model_states_mem_needs_all_cold.")
    if r.gpus_per_node > 1:
        notes.append(
            "ZeRO++ hpZ (zero_optimization.zero_hpz_partition_size H, at most the GPUs per "
            f"node) adds to ZeRO-3 a secondary parameter copy of {bpp.params}Ψ/H bytes per "
            f"GPU: +{format_gb(bpp.params * r.total_params / r.gpus_per_node)} GB with "
            f"H = {r.gpus_per_node} (docs/multinode.md).")
    if r.optimizer == "adam-bf16":
        notes.append("adam-bf16 (bf16.bf16_master_weights_and_grads with bf16_optimizer_states): "
                     "no stage 0 row (DeepSpeed asserts stages 1-3) and no NVMe row; at ZeRO-3 "
                     "the bf16 parameter shard is the master, so a rank holds 2Ψ/N less than "
                     "the row shows (8Ψ/N, docs/memory.md).")
    elif r.optimizer != "adam":
        notes.append("No NVMe row: zerotrain swaps only Adam/AdamW state to NVMe.")
    if r.gpu_memory or rep.activations:
        notes.append("need* = per GPU + fp32 gradient accumulation + activations + "
                     "ZeRO-3's gathered largest layer, where known.")
    lines = textwrap.wrap(notes[0], _WIDTH)
    for note in notes[1:]:
        lines += textwrap.wrap(note, _WIDTH, initial_indent="* ", subsequent_indent="  ")
    return lines


def _recommendation_lines(rep: EstimateReport) -> list[str]:
    rec = rep.recommendation
    if rec is None:
        return []
    lines = [""] + textwrap.wrap(f"Recommendation: {rec.reason}.", _WIDTH,
                                 subsequent_indent="  ")
    if rec.placement is None:
        return lines
    if rec.parts:
        lines.append("  " + " + ".join(f"{name} {format_gb(v)} GB"
                                       for name, v in rec.parts.items()))
    if rec.checkpointing:
        lines.append("  Only with activation checkpointing (torch.utils.checkpoint in the "
                     "model's blocks).")
    lines += textwrap.wrap("Rule: ZeRO-1 if need* fits in half the GPU, else the first of "
                           "ZeRO-2, ZeRO-3 and ZeRO-3 with offload whose need* fits in "
                           f"{SAFE_FRACTION:.0%} of it (activation checkpointing tried before "
                           "the next).", _WIDTH, initial_indent="  ", subsequent_indent="  ")
    if rec.placement.offload_optimizer == "nvme":
        lines += textwrap.wrap("Set zero_optimization.offload_optimizer.nvme_path to a "
                               "directory on a fast local NVMe drive before training.", _WIDTH,
                               initial_indent="  ", subsequent_indent="  ")
    lines += ["", "ds_config.json:", json.dumps(rep.config, indent=2)]
    return lines
