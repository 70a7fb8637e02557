"""Offload: fp32 master weights and optimizer state on the host (CPU RAM or NVMe files),
stepped there by torch's fused CPU Adam, and stage-3 parameter shards kept on the host.

``plan.py`` reads the config; ``storage.py`` allocates host tensors (pinned RAM, or files
under ``nvme_path``) and swaps NVMe-backed ones through pinned buffers; ``updater.py`` runs
the optimizer step on the host, one record at a time, overlapping the copies.
"""
from .plan import OffloadPlan
from .storage import HostStorage, NvmeStorage, build_param_storage, build_storage
from .updater import HostUpdater

__all__ = ["OffloadPlan", "HostStorage", "NvmeStorage", "HostUpdater", "build_param_storage",
           "build_storage"]
