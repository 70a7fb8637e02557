"""Tensor parallelism under ZeRO: DeepSpeed's AutoTP training (``tensor_parallel.autotp_size``).

One module per job: ``split`` (how a parameter is cut, pure arithmetic), ``rules`` (which
layers are cut: DeepSpeed's AutoTP names and user patterns), ``layers`` (the column- and
row-parallel linear layers; Note "plain slices, not DTensors"), ``apply`` (``parallelize``:
cutting a model), ``norm`` (the gradient norm over both dimensions), ``view`` (checkpoint
records with the tensor-parallel dimension gathered), ``stage`` (the ZeRO stage seen
over the whole mesh), ``model_init`` (DeepSpeed's record-only ``tp_model_init``) and
``inputs`` (the first forward's check that a group was given one batch) and ``zero3``
(stage 3 over the slices: the order and what it refuses). The
mesh and the two tensor-parallel collectives are in
``comm/mesh.py``. docs/tensor-parallel.md says what composes.
"""
from __future__ import annotations

from .apply import TensorParallelPlan, parallelize
from .model_init import check_recorded, tp_model_init
from .split import SplitSpec, join_slices, local_slice
from .stage import TensorParallelStage

__all__ = ["SplitSpec", "TensorParallelPlan", "TensorParallelStage", "join_slices",
           "local_slice", "parallelize", "check_recorded", "tp_model_init"]
