"""``zerotrain.zero``: DeepSpeed's ``deepspeed.zero`` names.

``GatheredParameters`` is a no-op for parameters that are not partitioned (stages 0-2), so
the same user code runs at every stage.
"""
from ..stages.zero3.zero_init import GatheredParameters, Init, register_external_parameter
from ..stages.zero3.ds_attrs import ZeroParamStatus
from .generation import unwrap_model_for_generation
from .tiling import TiledLinear, TiledLinearReturnBias

__all__ = ["GatheredParameters", "Init", "TiledLinear", "TiledLinearReturnBias",
           "ZeroParamStatus", "register_external_parameter", "unwrap_model_for_generation"]
