"""DeepSpeed's mixture-of-experts names: importable, unusable (``unsupported.py``)."""
from ..unsupported import stub_getattr
from . import layer, utils  # noqa: F401 - ``zerotrain.moe.layer.MoE`` without importing it

__getattr__ = stub_getattr(__name__, "mixture of experts (deepspeed.moe)")
