"""Offload: fp32 master weights and optimizer state on the host (CPU RAM or NVMe files),
stepped there by torch's fused CPU Adam, and stage-3 parameter shards kept on the host.

``plan.py`` reads the config; ``storage.py`` picks where state lives (the device; pinned
RAM, ``host_storage.py``; or files under ``nvme_path``, ``nvme.py``, which swaps them
through pinned buffers); ``updater.py`` runs the optimizer step on the host one record at a
time, overlapping the copies (``device.py``: on the device in one call), with Adam's moments
in NVMe files (``swapped_adam.py``) and its seconds by part (``step_timings.py``);
``speculation.py`` keeps state for the host step taken during backward; ``traffic.py``
counts the host memory each phase moves; ``trace.py`` writes the step's per-record timeline;
``states.py`` moves the states ``engine.offload_states`` names to the host and back.
``transfers.py`` issues every host/device copy on side streams and counts it in the copy
ledger; ``gradients.py`` holds the arithmetic that finishes a gradient (the same on either
side) and the pinned host copies streamed during backward; ``threads.py`` sizes the host
step's threads and steps one record alone. Stages receive a storage and an updater and never
branch on the offload configuration; without offload these are the device ones.
"""
from .gradients import Gradients, HostGradients
from .plan import OffloadPlan
from .storage import (DeviceStorage, HostStorage, NvmeStorage, Storage, build_param_storage,
                      build_storage, place_masters)
from .transfers import CopyLedger, Transfers
from .updater import DeviceUpdater, HostUpdater, build_updater

__all__ = ["CopyLedger", "Gradients", "HostGradients", "Transfers", "OffloadPlan",
           "DeviceStorage", "HostStorage", "NvmeStorage", "Storage",
           "DeviceUpdater", "HostUpdater", "build_param_storage", "build_storage",
           "build_updater", "place_masters"]
