"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp`` names (what Accelerate,
the Trainer and ALST scripts import through the switch)."""
from __future__ import annotations

from .attention import UlyssesSPAttentionHF
from .loader import UlyssesSPDataLoaderAdapter

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]
