"""``zerotrain.ops``: DeepSpeed's optimizer classes, backed by torch (nothing to compile).

``zerotrain.ops.adam.FusedAdam`` and ``DeepSpeedCPUAdam`` take DeepSpeed's constructor
arguments and are torch's Adam underneath, so a script that builds one and passes it to
``initialize(optimizer=...)`` runs unchanged.
"""
from . import adam, builder
from .adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "adam", "builder"]
__compatible_ops__ = builder.compatible_ops()   # DeepSpeed's name: op -> usable here
