"""DeepSpeed's mixture-of-experts names: importable, unusable (``unsupported.py``)."""
from ..unsupported import stub_getattr

__getattr__ = stub_getattr(__name__, "mixture of experts (deepspeed.moe)")
