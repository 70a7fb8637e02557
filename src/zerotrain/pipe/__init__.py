"""DeepSpeed's pipeline-parallel names (``PipelineModule``, ``LayerSpec``, the pipeline
engine): importable, unusable (``unsupported.py``)."""
from ..unsupported import stub_getattr

__getattr__ = stub_getattr(__name__, "pipeline parallelism (deepspeed.pipe)")
