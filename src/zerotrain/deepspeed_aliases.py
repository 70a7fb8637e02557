"""The ``deepspeed`` import switch's table (``as_deepspeed.py``): each ``deepspeed.X`` module
name and the zerotrain module it forwards to (Note "aliases, not copies" there). Data only,
apart from the switch's machinery, so an added DeepSpeed name is one line here."""
from __future__ import annotations

from typing import Optional

# deepspeed module name -> zerotrain module it forwards to (None: a package of aliases only)
ALIASES: dict[str, Optional[str]] = {
    "deepspeed": "zerotrain",
    "deepspeed.accelerator": "zerotrain.accelerator",
    "deepspeed.comm": "zerotrain.comm",
    "deepspeed.comm.comm": "zerotrain.comm",
    "deepspeed.ops": "zerotrain.ops",
    "deepspeed.ops.adam": "zerotrain.ops.adam",
    "deepspeed.ops.adam.fused_adam": "zerotrain.ops.adam",
    "deepspeed.ops.adam.cpu_adam": "zerotrain.ops.adam",
    "deepspeed.utils": "zerotrain.utils",
    "deepspeed.utils.logging": "zerotrain.utils",
    "deepspeed.utils.zero_to_fp32": "zerotrain.checkpoint.consolidate",
    "deepspeed.zero": "zerotrain.zero",
    "deepspeed.checkpointing": "zerotrain.checkpointing",
    "deepspeed.moe": "zerotrain.moe",
    "deepspeed.moe.experts": "zerotrain.moe.experts",
    "deepspeed.moe.layer": "zerotrain.moe.layer",
    "deepspeed.moe.utils": "zerotrain.moe.utils",
    "deepspeed.pipe": "zerotrain.pipe",
    "deepspeed.runtime": None,
    "deepspeed.runtime.engine": "zerotrain",
    "deepspeed.runtime.zero": "zerotrain.zero",
    "deepspeed.runtime.zero.partition_parameters": "zerotrain.zero.partition_parameters",
    "deepspeed.runtime.zero.stage3": "zerotrain.estimate",          # the memory estimators
    "deepspeed.runtime.zero.stage_1_and_2": "zerotrain.estimate",
    "deepspeed.runtime.activation_checkpointing": None,
    "deepspeed.runtime.activation_checkpointing.checkpointing": "zerotrain.checkpointing",
    "deepspeed.runtime.lr_schedules": "zerotrain.schedules",
    "deepspeed.runtime.dataloader": "zerotrain.dataloader",
    "deepspeed.runtime.utils": "zerotrain.core.runtime_utils",
    "deepspeed.runtime.pipe": "zerotrain.pipe",
    "deepspeed.runtime.pipe.engine": "zerotrain.pipe",
    "deepspeed.runtime.pipe.module": "zerotrain.pipe",
    # Trainer and Accelerate through the switch
    "deepspeed.checkpoint": None,
    "deepspeed.checkpoint.utils": "zerotrain.checkpoint.ds_utils",
    "deepspeed.runtime.zero.offload_config": "zerotrain.offload_names",
    # ``accelerate launch --use_deepspeed`` (its launcher's constants only)
    "deepspeed.launcher": None,
    "deepspeed.launcher.runner": "zerotrain.launcher_names",
    # Ulysses sequence parallelism (ALST)
    "deepspeed.utils.groups": "zerotrain.comm.groups",
    "deepspeed.runtime.sequence_parallel": None,
    "deepspeed.runtime.sequence_parallel.ulysses_sp": "zerotrain.sequence.ulysses_sp",
    "deepspeed.runtime.sequence_parallel.parallel_state_sp": "zerotrain.comm.parallel_state_sp",
}
# DeepSpeed's names its own unit tests and their harness import: build and op records,
# runtime.zero.config's models, and the optimizer classes for isinstance (optim/kinds.py).
ALIASES.update({
    "deepspeed.accelerator.real_accelerator": "zerotrain.accelerator",
    "deepspeed.git_version_info": "zerotrain.ops.builder",
    "deepspeed.ops.op_builder": "zerotrain.ops.builder",
    "deepspeed.ops.aio": "zerotrain.ops.builder",
    "deepspeed.utils.torch": "zerotrain.ops.builder",
    "deepspeed.runtime.swap_tensor": "zerotrain.ops.builder",
    "deepspeed.runtime.zero.config": "zerotrain.config.deepspeed_zero",
    "deepspeed.runtime.zero.stage3": "zerotrain.optim.kinds",          # and the estimators
    "deepspeed.runtime.zero.stage_1_and_2": "zerotrain.optim.kinds",
    "deepspeed.runtime.zero.utils": "zerotrain.optim.kinds",   # ZeRORuntimeException
    "deepspeed.runtime.base_optimizer": "zerotrain.optim.kinds",
    "deepspeed.runtime.bf16_optimizer": "zerotrain.optim.kinds",
    "deepspeed.runtime.fp16": None,
    "deepspeed.runtime.fp16.fused_optimizer": "zerotrain.optim.kinds",
    "deepspeed.runtime.fp16.unfused_optimizer": "zerotrain.optim.kinds",
})
# More of DeepSpeed's own ZeRO unit tests: the leaf-module defaults.
ALIASES.update({
    "deepspeed.runtime.zero.leaf_module_config": "zerotrain.config.zero",
    "deepspeed.runtime.zero.tiling": "zerotrain.zero.tiling",
    "deepspeed.runtime.zero.offload_states": "zerotrain.utils",   # get_state_devices
    "deepspeed.runtime.zero.linear": "zerotrain.zero.linear",
    # ZeROOrderedDict, ensure_zero_ordered_dict (Note "parameters the engine does not hold")
    "deepspeed.runtime.zero.parameter_offload": "zerotrain.stages.param_watch",
})
