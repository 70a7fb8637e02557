"""DeepSpeed's mixture-of-experts package: the ``MoE`` layer at expert-parallel size 1
(``layer.py``: gate, experts, dispatch in modules of their own) and the optimizer-group
helpers (``utils.py``)."""
from . import layer, utils  # noqa: F401 - ``zerotrain.moe.layer.MoE`` without importing it
