"""Muon (DeepSpeed's ``"optimizer": {"type": "Muon"}`` and a client ``torch.optim.Muon``)
under ZeRO stages 0-3: ``groups.py`` flags and splits the parameters, ``sharded.py`` steps
the shards, ``newton_schulz.py`` holds the arithmetic."""
from .groups import muon_param_groups, tag_model
from .sharded import ShardedMuon

__all__ = ["ShardedMuon", "muon_param_groups", "tag_model"]
