"""``zerotrain.zero``: DeepSpeed's ``deepspeed.zero`` names.

``GatheredParameters`` is a no-op for parameters that are not partitioned (stages 0-2), so
the same user code runs at every stage.
"""
from ..stages.zero3.zero_init import GatheredParameters, Init, register_external_parameter
from ..stages.zero3.partition import ZeroParamStatus
from .generation import unwrap_model_for_generation

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unwrap_model_for_generation"]
