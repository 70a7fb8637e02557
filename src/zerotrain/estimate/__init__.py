"""``zerotrain estimate``: how much memory per GPU a model needs at each ZeRO stage.

No process group and no GPU: this is arithmetic on the ZeRO paper's table (see
:mod:`zerotrain.estimate.states`, Note "the ZeRO table"), extended with offload, fp32 and
SGD, an activation estimate for transformer shapes (:mod:`~zerotrain.estimate.models`), a
stage recommendation with a ready DeepSpeed config (:mod:`~zerotrain.estimate.plan`), and
DeepSpeed's own estimator API (:mod:`~zerotrain.estimate.deepspeed_api`). torch is imported
only by the functions that build or read an ``nn.Module``.
"""
from __future__ import annotations

from .deepspeed_api import (
    MemoryNeed,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    model_to_params,
)
from .models import (ModelShape, activation_bytes, shape_from_hf_config, shape_from_module,
                     shape_from_module_spec)
from .plan import Budget, Recommendation, ds_config, recommend
from .report import EstimateReport, EstimateRequest, estimate
from .sizes import format_count, format_gb, parse_bytes, parse_count
from .states import (DTYPES, OPTIMIZERS, PLACEMENTS, BytesPerParam, Placement, StateEstimate,
                     fp32_accumulation_extra, gpu_shares, model_states, off_gpu_shares)

__all__ = [
    "BytesPerParam", "Budget", "DTYPES", "EstimateReport", "EstimateRequest", "MemoryNeed",
    "ModelShape", "OPTIMIZERS", "PLACEMENTS", "Placement", "Recommendation", "StateEstimate",
    "activation_bytes", "ds_config", "estimate", "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live", "format_count", "format_gb",
    "fp32_accumulation_extra", "gpu_shares", "model_states", "model_to_params",
    "off_gpu_shares", "parse_bytes",
    "parse_count", "recommend", "shape_from_hf_config", "shape_from_module",
    "shape_from_module_spec",
]
