"""ZeRO stage 3: partitioned parameters gathered per unit around their use."""
from .zero_init import GatheredParameters, Init, register_external_parameter
from .stage import PartitionedDataParallel

__all__ = ["GatheredParameters", "Init", "PartitionedDataParallel",
           "register_external_parameter"]
