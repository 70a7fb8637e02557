"""DeepSpeed's engine accessors: the one-line questions a script asks the engine.

Why a module of its own: DeepSpeed's engine carries about a hundred one-line accessors
(``train_batch_size()``, ``zero_optimization_stage()``, ``get_mom()``...). Scripts call them,
so the engine answers them, but they read configuration and own nothing; kept here, as a
mixin :class:`ZeroEngine` inherits, they stay out of the engine's training logic.

Each answers as DeepSpeed's engine does (``deepspeed/runtime/engine.py``), with three
deliberate differences, each named where it is: ``get_batch_info()`` returns the three
numbers (DeepSpeed's returns the three bound methods), ``dynamic_loss_scale()`` is False
without fp16 (DeepSpeed says True for fp32, where nothing is scaled), and the only model
parallelism is tensor parallelism (``mp_world_size`` is its size T, 1 without it; the
data-parallel group is the world, or world / T of it).

The mixin reads what the engine sets in ``__init__``: ``config`` (``ZeroTrainConfig``),
``comm`` (its world), ``optimizer`` and ``stage`` (whose ``optimizer`` is the torch
optimizer over the shards), ``loss_scaler``, ``_autocast_dtype`` (``engine/autocast.py``)
and ``accumulation_window`` (``window.py``: the last update's outcome, whether a backward
ran since); ``destroy()`` is the engine's ``close()``.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from ..checkpoint.save import rank_file
from ..optim import ZeroOptimizer
from ..stages.factory import partitions_gradients, partitions_parameters, shards_optimizer
from .optimizer_views import OptimizerViews

# Config optimizer types DeepSpeed names in lower case (its DEEPSPEED_OPTIMIZERS); others,
# torch's SGD among them, keep their spelling.
_LOWER_CASE_NAMES = frozenset({"adam", "adamw", "muon"})

if TYPE_CHECKING:
    from .surface import EngineSurface
else:
    EngineSurface = object   # typing only (surface.py)


class DeepSpeedEngineAPI(EngineSurface):
    """DeepSpeed's configuration and parallelism accessors, for :class:`ZeroEngine`."""


    # ------------------------------------------------------------------ batch sizes
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``
        (DeepSpeed's returns the three methods uncalled; these are their values)."""
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps())

    # ------------------------------------------------------------------ parallelism
    @property
    def dp_world_size(self) -> int:
        """Ranks of the data-parallel group: every rank, or world / T with
        ``tensor_parallel.autotp_size`` T (``zerotrain.tp``), or world / S with
        ``sequence_parallel_size`` S (the ranks that draw different samples)."""
        known = self.stage.data_parallel_world_size
        return known if known is not None else self.comm.world_size // self.sequence_parallel_size

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks sharing each sequence (Ulysses, ``zerotrain.sequence``); 1 without."""
        return self.config.sequence_parallel_size

    def get_sequence_parallel_group(self):
        """The process group of this rank's sequence-parallel group (DeepSpeed's accessor);
        None without sequence parallelism."""
        from ..comm import parallel_state_sp
        return (parallel_state_sp.get_sequence_parallel_group()
                if self.sequence_parallel_size > 1 else None)

    @property
    def mp_world_size(self) -> int:
        """Model-parallel ranks: the tensor-parallel size T (1 without tensor parallelism;
        no pipeline parallelism)."""
        return self.stage.tensor_parallel_world_size

    def get_data_parallel_world_size(self) -> int:
        return self.dp_world_size

    def get_data_parallel_rank(self) -> int:
        # Note "the mesh" in comm/mesh.py and "the sequence mesh" in comm/sequence.py
        return self.comm.rank // (self.mp_world_size * self.sequence_parallel_size)

    # ------------------------------------------------------------------ ZeRO
    def zero_optimization(self) -> bool:
        """Whether ZeRO partitions anything (stage above 0), as DeepSpeed's ``zero_enabled``."""
        return shards_optimizer(self.config.zero_optimization.stage)

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return partitions_gradients(self.zero_optimization_stage())

    def zero_optimization_partition_weights(self) -> bool:
        return partitions_parameters(self.zero_optimization_stage())

    def zero_offload_optimizer(self) -> Any:
        """The ``offload_optimizer`` section (its ``device``, ``pin_memory``...), or None."""
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Any:
        """The ``offload_param`` section, or None."""
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state is offloaded to host memory (``device: cpu``)."""
        section = self.zero_offload_optimizer()
        return section is not None and section.device == "cpu"

    def zero_force_ds_cpu_optimizer(self) -> bool:
        """DeepSpeed's key: whether an offloaded client optimizer must be DeepSpeedCPUAdam."""
        return self.config.zero_force_ds_cpu_optimizer

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the optimizer steps on the host (state offloaded to ``cpu`` or ``nvme``)."""
        section = self.zero_offload_optimizer()
        return section is not None and section.device in ("cpu", "nvme")

    # ------------------------------------------------------------------ optimizer
    def optimizer_name(self) -> Optional[str]:
        """The client optimizer's class name, else the config's ``optimizer.type`` (``adam``,
        ``adamw`` and ``muon`` in lower case, as DeepSpeed normalises them); None without one."""
        if self.config.optimizer is not None:
            name = self.config.optimizer.type
            return name.lower() if name.lower() in _LOWER_CASE_NAMES else name
        if not self.optimizer.param_groups:   # an engine for forward only
            return None
        stepped = self.stage.optimizer
        return type(getattr(stepped, "client", stepped)).__name__   # torch.optim.Muon: Muon

    def get_mom(self) -> list:
        """Per parameter group: ``momentum`` for SGD and RMSprop, else ``betas`` (0.0 where
        a group lacks it)."""
        key = "momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas"
        return [group.get(key, 0.0) for group in self.optimizer.param_groups]

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    # ------------------------------------------------------------------ precision
    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    def bf16_master_weights_and_gradients(self) -> bool:
        return self.config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self.config.bf16.bf16_optimizer_states

    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> Optional[torch.dtype]:
        """The autocast's dtype (None when off), torch's default for the device if unset."""
        return self._autocast_dtype

    def dynamic_loss_scale(self) -> bool:
        """Whether fp16 runs with dynamic loss scaling (``fp16.loss_scale`` 0). False without
        fp16 (DeepSpeed also says True for fp32, where nothing is scaled)."""
        return self.fp16_enabled() and self.config.fp16.loss_scale == 0

    # ------------------------------------------------------------------ logging
    def steps_per_print(self) -> Union[int, float]:
        """Steps between progress lines (``inf``: never, as Accelerate sets it)."""
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    # -------------------------------------------- engine attributes DeepSpeed's tests read
    @property
    def optimizer(self) -> Any:
        return self.__dict__.get("_optimizer_object")

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        """The engine's optimizer, bound to this engine's views when it is zerotrain's, so
        DeepSpeed's optimizer attributes (``averaged_gradients``...) can answer."""
        if isinstance(value, ZeroOptimizer):
            value.views = OptimizerViews(self)
        self.__dict__["_optimizer_object"] = value

    def allreduce_gradients(self, bucket_size: Any = None) -> None:
        """DeepSpeed's explicit reduction after ``backward()``: finish every gradient
        reduction still in flight. zerotrain reduces at the end of the accumulation
        window's backward by itself, so this only waits for it (``bucket_size`` is
        DeepSpeed's and unused)."""
        self.settle()
        window = self.accumulation_window
        if window.backward_in_window and self.is_gradient_accumulation_boundary():
            self.stage.buckets.collect()

    @property
    def sparse_tensor_module_names(self) -> set[str]:
        """Modules whose gradients DeepSpeed reduces as sparse tensors (``sparse_gradients``).
        zerotrain reduces every gradient dense (the key is accepted without effect), so
        none: DeepSpeed's checkpoint tests compare this set before and after a load."""
        return set()

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag: Any,
                                 expp_rank: int = 0) -> str:
        """The file this rank's optimizer state is read from: zerotrain keeps it in the
        rank's shard file of the tag, beside the weights. DeepSpeed's checkpoint tests
        wrap this to check that a load without optimizer states asks for no such file."""
        return os.path.join(checkpoints_path, str(tag), rank_file(self.comm.rank))

    # ------------------------------------------------------------------ the last step
    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` updated the parameters: False for one between
        accumulation boundaries or one skipped on overflow."""
        return self.accumulation_window.step_applied

    def get_global_grad_norm(self) -> Optional[float]:
        outcome = self.accumulation_window.last_outcome
        return None if outcome is None else outcome.grad_norm

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ saving, closing
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's name for ``stage3_gather_16bit_weights_on_model_save`` (Accelerate
        asks it before saving a stage-3 model)."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: free the full parameters stage 3 still holds gathered between steps
        (persistent ones stay); nothing is gathered to free at stages 0-2."""
        self.stage.empty_partition_cache()

    def destroy(self) -> None:
        """DeepSpeed's name for :meth:`close`."""
        self.close()
