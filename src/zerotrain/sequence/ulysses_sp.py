"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp`` names (what Accelerate,
the Trainer and ALST scripts import through the switch): the Ulysses attention and loader,
and the tiled compute along the sequence that goes with them."""
from __future__ import annotations

from .attention import UlyssesSPAttentionHF
from .loader import UlyssesSPDataLoaderAdapter
from .tiled import (AutogradComputeMLP, SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP,
                    sequence_tiled_compute)

__all__ = ["AutogradComputeMLP", "SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP",
           "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute"]
