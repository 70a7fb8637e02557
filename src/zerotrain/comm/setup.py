"""Process-group set-up: making or adopting the default group, and what it serves.

Why a module of its own: the questions asked once per process (which backend serves which
device, which device this rank trains on, how long collectives may wait, how torchrun's
store is reached after a restart) are separate from the collectives themselves, and the
engine's set-up asks them before any :class:`~zerotrain.comm.Communicator` exists.

Note: the training device
    The device comes from the launcher, never from the backend's name: ``cuda:LOCAL_RANK``
    (or the current CUDA device when ``LOCAL_RANK`` is unset) when CUDA is available and the
    group has a CUDA backend other than gloo, else the CPU (:func:`select_device`). A group
    made with ``init_process_group()`` and no backend, or with ``"cpu:gloo,cuda:nccl"``,
    therefore trains on the GPU. :func:`init_distributed` calls ``set_device`` before the
    group exists and passes ``device_id``, so NCCL binds each rank to its own GPU; for a
    group the user created, ``initialize`` calls ``set_device`` itself.
"""
from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from . import teardown

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                     init_method: Optional[str] = None, dist_init_required: Optional[bool] = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """Initialise the default process group, as ``deepspeed.init_distributed`` does.

    The backend is NCCL when CUDA is available and gloo otherwise. Rank and world size come
    from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
    With none of that set, a single process group of world size 1 is created in memory, so a
    script runs unchanged on one process without inventing a master address. Calling it
    again once initialised does nothing. ``auto_mpi_discovery``, ``distributed_port``,
    ``verbose``, ``dist_init_required`` and ``config`` are accepted for DeepSpeed
    compatibility. Either way (a new group or an adopted one) it registers the exit teardown
    of ``teardown.py`` (Note: exit aborts).
    """
    if dist.is_initialized():
        teardown.install()
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    env_world = int(os.environ.get("WORLD_SIZE", world_size if world_size > 0 else 1))
    env_rank = int(os.environ.get("RANK", rank if rank >= 0 else 0))
    device = select_device(_backend_map(backend))
    extra: dict = {}
    if device.type == "cuda":   # Note: the training device
        torch.cuda.set_device(device)
        extra["device_id"] = device
    if init_method is None and "MASTER_ADDR" not in os.environ:
        if env_world != 1:
            raise RuntimeError(
                f"WORLD_SIZE={env_world} but MASTER_ADDR is not set: launch with torchrun "
                "(or zerotrain launch), which sets the rendezvous variables")
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout,
                                **extra)
    elif init_method is None and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        dist.init_process_group(backend, store=_elastic_store(env_rank, env_world, timeout),
                                rank=env_rank, world_size=env_world, timeout=timeout, **extra)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=env_rank,
                                world_size=env_world, timeout=timeout, **extra)
    teardown.install()
    if verbose:
        logger.info("initialised %s process group: rank %d of %d", backend,
                    dist.get_rank(), dist.get_world_size())


def group_backends(group: Optional[dist.ProcessGroup] = None) -> dict[str, str]:
    """Which backend serves each device type in ``group``: ``{"cpu": "gloo", "cuda":
    "nccl"}`` for ``"cpu:gloo,cuda:nccl"``, ``{"cuda": "nccl"}`` for ``"nccl"``."""
    return _backend_map(str(dist.get_backend_config(group)))


def _backend_map(backend: str) -> dict[str, str]:
    """Parse a backend string (``"nccl"``, ``"cpu:gloo,cuda:nccl"``) into device -> name."""
    backend = backend.lower()
    if ":" not in backend:
        if backend == "undefined":   # init_process_group() without a backend
            return ({"cpu": "gloo", "cuda": "nccl"} if torch.cuda.is_available()
                    else {"cpu": "gloo"})
        devices = dist.Backend.backend_capability.get(backend, ["cpu"])
        return {device: backend for device in devices}
    pairs = (item.split(":", 1) for item in backend.split(",") if item.strip())
    return {device.strip(): name.strip() for device, name in pairs}


def select_device(backends: Mapping[str, str]) -> torch.device:
    """The training device of this rank (Note: the training device).

    ``backends`` maps device types to backend names (:func:`group_backends`). CUDA is used
    when it is available and a backend other than gloo serves it (gloo reduces CUDA tensors
    through the host, and not every collective); the index is ``LOCAL_RANK``, else the
    current device. Raises RuntimeError when ``LOCAL_RANK`` names a GPU that does not exist.
    """
    if not torch.cuda.is_available() or backends.get("cuda", "gloo") == "gloo":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    local = os.environ.get("LOCAL_RANK")
    index = int(local) if local is not None else torch.cuda.current_device()
    if not 0 <= index < count:
        raise RuntimeError(f"LOCAL_RANK={local} but this node has {count} CUDA device(s): "
                           "start at most one process per GPU (torchrun --nproc_per_node)")
    return torch.device("cuda", index)


def group_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[datetime.timedelta]:
    """The timeout ``group``'s backend runs with (default: the default group's), or None when
    torch does not say; subgroups are made with it, so they keep ``comms_timeout`` (torch
    would give them its 30-minute default)."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:   # no process group: torch has nothing to say
        return None
    for device in ("cuda", "cpu"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def set_group_timeout(timeout: datetime.timedelta,
                      group: Optional[dist.ProcessGroup] = None) -> None:
    """Give an existing group (default: the default group) ``timeout`` for its collectives.

    ``initialize`` calls it when it adopts a group made before it (``init_distributed`` or
    ``init_process_group`` first, the Trainer's path), so ``comms_timeout`` holds there too.
    """
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:   # older torch
        logger.warning("comms_timeout cannot be applied to the existing process group with "
                       "torch %s; its own timeout stays", torch.__version__)
        return
    setter(timeout, group)


def _elastic_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, with keys private to this restart attempt.

    Note: restarts
        After torchrun restarts the workers (``--max-restarts``), gloo's rendezvous can read
        the previous attempt's addresses from the shared store and fail with "connectFullMesh
        ... Connection refused" (seen with torch 2.13). Prefixing every key with the attempt
        number keeps each attempt's rendezvous to itself.
    """
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    return dist.PrefixStore(f"/zerotrain/attempt_{attempt}/", base)
