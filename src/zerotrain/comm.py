"""The only module that calls torch.distributed collectives.

Every collective goes through a :class:`Communicator`, which records it in a
:class:`CommLedger`. The ledger counts what each call puts on the wire by the usual rule:
``all_reduce`` counts twice its tensor, ``reduce_scatter`` its input, ``all_gather`` its
output, ``broadcast`` and ``all_to_all`` their input. Tests read the ledger to check the ZeRO
volumes (2Ψ for stages 0-2) instead of trusting the design.

Note: the training device
    The device comes from the launcher, never from the backend's name: ``cuda:LOCAL_RANK``
    (or the current CUDA device when ``LOCAL_RANK`` is unset) when CUDA is available and the
    group has a CUDA backend other than gloo, else the CPU (:func:`select_device`). A group
    made with ``init_process_group()`` and no backend, or with ``"cpu:gloo,cuda:nccl"``,
    therefore trains on the GPU. :func:`init_distributed` calls ``set_device`` before the
    group exists and passes ``device_id``, so NCCL binds each rank to its own GPU; for a
    group the user created, ``initialize`` calls ``set_device`` itself.

Note: collective devices
    Every tensor handed to a collective must be on a device the group's backend serves, and
    a CUDA tensor on the current device (NCCL would otherwise fail deep inside, or hang).
    :class:`Communicator` checks this before each call; the check is a few comparisons, so
    it is always on and every distributed test runs its collectives through it.

Note: intra-node and cross-node bytes
    Each communicator knows the nodes of its members (``topology.py``). A collective over a
    group whose members all share a node is counted as ``intra_node`` bytes; one over a
    group spanning nodes as ``cross_node`` bytes, whole: in a ring over several nodes every
    element passes the links between nodes, so the counted volume is what the slow network
    carries. Hierarchical schemes (hpZ, MiCS, quantized gradients) win by running part of
    their traffic on node groups and shrinking what the cross-node groups carry.

Note: coalesced gathers
    :meth:`Communicator.all_gather_into_many` runs several all-gathers, each into an output
    of its own (stage 3 gathers every parameter of a unit straight into its place in the
    unit's full buffer), as one launch: torch's ``_coalescing_manager`` collects them and
    hands them to the backend together (one NCCL group call; gloo runs them as one
    coalesced gather). Where torch has no coalescing manager, or the backend refuses the
    coalesced call, each gather is launched on its own, asynchronously, in the same order;
    the results are the same, only the launch count differs. The backend is the same on
    every rank, so every rank takes the same path and the collectives pair up.
"""
from __future__ import annotations

import datetime
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from . import teardown
from .errors import CollectiveError  # defined there; importable from here too
from .topology import Partition, Topology, group_of, local_node_entry

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

# torch 2.13 renames the tensor collectives; torch 2.4 only has the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_coalescing_manager = getattr(dist.distributed_c10d, "_coalescing_manager", None)


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


REACHES = ("intra_node", "cross_node")


@dataclass
class CommLedger:
    """Counts collectives and the elements/bytes they move, per operation name; bytes are
    also split by reach (Note: intra-node and cross-node bytes)."""

    calls: Counter = field(default_factory=Counter)
    elements: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)
    by_reach: dict = field(default_factory=lambda: {r: Counter() for r in REACHES})

    def record(self, op: str, tensor: torch.Tensor, factor: int = 1,
               reach: str = "intra_node") -> None:
        nbytes = factor * tensor.numel() * tensor.element_size()
        self.calls[op] += 1
        self.elements[op] += factor * tensor.numel()
        self.nbytes[op] += nbytes
        self.by_reach[reach][op] += nbytes

    def record_many(self, op: str, tensors: Sequence[torch.Tensor], *, calls: int,
                    reach: str = "intra_node") -> None:
        """``tensors`` moved by ``calls`` launches (coalesced collectives): elements and
        bytes as if each were recorded, the launches counted as calls."""
        if not tensors:
            return
        numel = sum(t.numel() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.calls[op] += calls
        self.elements[op] += numel
        self.nbytes[op] += nbytes
        self.by_reach[reach][op] += nbytes

    def total_elements(self) -> int:
        return sum(self.elements.values())

    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    def reach_bytes(self, reach: str) -> int:
        """Bytes of every operation over groups of that reach (intra_node, cross_node)."""
        return sum(self.by_reach[reach].values())

    def reset(self) -> None:
        self.calls.clear()
        self.elements.clear()
        self.nbytes.clear()
        for counter in self.by_reach.values():
            counter.clear()

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "elements": dict(self.elements),
                "bytes": dict(self.nbytes),
                **{f"{r}_bytes": dict(self.by_reach[r]) for r in REACHES}}


# Process groups are costly to create and never freed by torch before shutdown: each
# partition gets its group once per process (keyed by the default group it was made from).
_SUBGROUPS: dict[tuple, dist.ProcessGroup] = {}


class Communicator:
    """Collectives over one process group, each recorded in ``ledger``.

    Every method must be called by all ranks of the group in the same order. Methods with
    ``async_op=True`` return a work handle whose ``wait()`` must be called before the result
    is read; otherwise they return None.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, debug: bool = False,
                 topology: Optional[Topology] = None,
                 ledger: Optional[CommLedger] = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ledger = CommLedger() if ledger is None else ledger
        self.debug = debug
        self.backends = group_backends(group)
        self.ranks: tuple[int, ...] = (tuple(dist.get_process_group_ranks(group))
                                       if group is not None else tuple(range(self.world_size)))
        self.topology = topology or Topology.single_node(dist.get_rank(),
                                                         dist.get_world_size())
        self.reach = "cross_node" if self.topology.spans_nodes(self.ranks) else "intra_node"
        self._coalesce = _coalescing_manager is not None   # Note: coalesced gathers

    # ------------------------------------------------------------------ topology
    def discover_topology(self) -> Topology:
        """Every rank's node from torchrun's environment (``topology.py``), exchanged once.

        Collective over the default group: every rank calls it; all get the same result.
        """
        if self.group is not None:
            raise ValueError("discover_topology runs on the default (world) group")
        entry = local_node_entry(self.rank, self.world_size)
        entries = self.all_gather_object(entry) if self.world_size > 1 else [entry]
        return Topology.from_entries(self.rank, [tuple(e) for e in entries])

    def with_topology(self, topology: Topology) -> "Communicator":
        """This group again, its bytes classified by ``topology``, into the same ledger."""
        return Communicator(self.group, debug=self.debug, topology=topology,
                            ledger=self.ledger)

    def subgroup(self, partition: Partition) -> "Communicator":
        """The group of ``partition`` (global rank lists) holding this rank, recording into
        this communicator's ledger. Collective over the default group the first time a
        partition is asked for (every rank must ask for the same partitions in the same
        order); created once per process and reused after."""
        key = (id(dist.group.WORLD), tuple(tuple(ranks) for ranks in partition))
        group_of(key[1], dist.get_rank())   # raises if the partition misses this rank
        group = _SUBGROUPS.get(key)
        if group is None:
            group, _ = dist.new_subgroups_by_enumeration([list(r) for r in key[1]],
                                                         timeout=group_timeout())
            _SUBGROUPS[key] = group
        return Communicator(group, debug=self.debug, topology=self.topology,
                            ledger=self.ledger)

    @property
    def device(self) -> torch.device:
        """Where this group's tensors go: the current GPU when a CUDA backend other than
        gloo serves the group, else the CPU (offloaded state on the host is copied here
        before it is communicated)."""
        if torch.cuda.is_available() and self.backends.get("cuda", "gloo") != "gloo":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def check_devices(self, op: str, label: str, *tensors: torch.Tensor) -> None:
        """Raise CollectiveError unless every tensor is where this group can communicate it
        (Note: collective devices)."""
        for tensor in tensors:
            device = tensor.device
            served = device.type in self.backends
            if served and device.type == "cuda":
                served = device.index == torch.cuda.current_device()
            if not served:
                raise CollectiveError(
                    f"rank {self.rank}: {op}{f' for {label}' if label else ''} got a tensor "
                    f"on {device}, but this group ({_describe(self.backends)}) communicates "
                    f"on {self.device}; move it there first")

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False,
                   label: str = ""):
        """In-place reduction of ``tensor`` over all ranks (``op``: sum, max, min, avg)."""
        self.check_devices("all_reduce", label, tensor)
        self.ledger.record("all_reduce", tensor, factor=2, reach=self.reach)
        return self._call("all_reduce", tensor, label, async_op, lambda: dist.all_reduce(
            tensor, op=_reduce_op(op), group=self.group, async_op=async_op))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       async_op: bool = False, label: str = ""):
        """Sum ``input`` (``world * n`` elements) over ranks; rank r gets slice r in ``output``."""
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(f"reduce_scatter input has {input.numel()} elements, expected "
                             f"{self.world_size} x {output.numel()}")
        self.check_devices("reduce_scatter", label, output, input)
        self.ledger.record("reduce_scatter", input, reach=self.reach)
        return self._call("reduce_scatter", input, label, async_op, lambda: _reduce_scatter(
            output, input, group=self.group, async_op=async_op))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   label: str = ""):
        """Concatenate every rank's ``input`` (``n`` elements) into ``output`` in rank order."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(f"all_gather output has {output.numel()} elements, expected "
                             f"{self.world_size} x {input.numel()}")
        self.check_devices("all_gather", label, output, input)
        self.ledger.record("all_gather", output, reach=self.reach)
        return self._call("all_gather", output, label, async_op, lambda: _all_gather(
            output, input, group=self.group, async_op=async_op))

    def all_gather_into_many(self, outputs: Sequence[torch.Tensor],
                             inputs: Sequence[torch.Tensor], *, label: str = ""):
        """All-gathers of several tensors launched together, asynchronously: every rank's
        ``inputs[i]`` (``n_i`` elements) concatenated in rank order into ``outputs[i]``
        (``world * n_i`` elements, written in place: views of one buffer are fine). One
        launch where the backend coalesces (Note: coalesced gathers). Bytes are counted as
        ``all_gather``'s, the outputs', and calls as the launches made. Returns a handle
        whose ``wait()`` must be called before the outputs are read; all ranks call it with
        the same sizes in the same order."""
        if len(outputs) != len(inputs):
            raise ValueError(f"all_gather_into_many got {len(outputs)} outputs for "
                             f"{len(inputs)} inputs")
        for i, (output, input) in enumerate(zip(outputs, inputs)):
            if output.numel() != input.numel() * self.world_size:
                raise ValueError(f"all_gather_into_many output {i} has {output.numel()} "
                                 f"elements, expected {self.world_size} x {input.numel()}")
        self.check_devices("all_gather", label, *outputs, *inputs)
        if not self.debug:
            launches = self._gather_many(outputs, inputs)
        else:
            what = (f"rank {self.rank}: all_gather of {len(outputs)} tensors "
                    f"({sum(o.numel() for o in outputs)} elements"
                    + (f", {outputs[0].dtype}" if outputs else "") + ")"
                    + (f" for {label}" if label else ""))
            logger.debug("%s", what)
            try:
                launches = _DescribedWork(self._gather_many(outputs, inputs), what)
            except Exception as exc:
                raise CollectiveError(f"{what} failed: {exc}") from exc
        self.ledger.record_many("all_gather", outputs, calls=launches.count, reach=self.reach)
        return launches

    def _gather_many(self, outputs: Sequence[torch.Tensor],
                     inputs: Sequence[torch.Tensor]) -> "_Launches":
        """Launch the gathers: coalesced when possible, else one by one (Note: coalesced
        gathers); a refused coalesced call is logged once and not tried again."""
        pairs = list(zip(outputs, inputs))
        if len(pairs) > 1 and self._coalesce:
            try:
                with _coalescing_manager(self.group, None, async_ops=True) as cm:
                    for output, input in pairs:
                        _all_gather(output, input, group=self.group, async_op=True)
                return _Launches(list(cm.works), 1, inputs)
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                _drop_coalescing_state(self.group)
                logger.info("coalesced all-gather unavailable (%s); gathering one by one", exc)
                self._coalesce = False
        works = [_all_gather(output, input, group=self.group, async_op=True)
                 for output, input in pairs]
        return _Launches(works, len(works), inputs)

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, async_op: bool = False,
                  label: str = ""):
        """Overwrite ``tensor`` on every rank with rank ``src``'s (a global rank)."""
        self.check_devices("broadcast", label, tensor)
        self.ledger.record("broadcast", tensor, reach=self.reach)
        return self._call("broadcast", tensor, label, async_op, lambda: dist.broadcast(
            tensor, src=src, group=self.group, async_op=async_op))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   label: str = ""):
        """Rank r's ``input`` is cut into ``world`` equal parts; part j goes to rank j, which
        stores it as part r of its ``output`` (same sizes)."""
        if input.numel() != output.numel() or input.numel() % self.world_size:
            raise ValueError(f"all_to_all needs equal input and output sizes divisible by "
                             f"{self.world_size}, got {input.numel()} and {output.numel()}")
        self.check_devices("all_to_all", label, output, input)
        self.ledger.record("all_to_all", input, reach=self.reach)
        return self._call("all_to_all", input, label, async_op, lambda: dist.all_to_all_single(
            output, input, group=self.group, async_op=async_op))

    def _call(self, op: str, tensor: torch.Tensor, label: str, async_op: bool, launch):
        """Run a collective; with ``debug``, log it and name it in any error."""
        if not self.debug:
            return launch()
        what = (f"rank {self.rank}: {op} of {tuple(tensor.shape)} {tensor.dtype}"
                + (f" for {label}" if label else ""))
        logger.debug("%s", what)
        try:
            work = launch()
        except Exception as exc:
            raise CollectiveError(f"{what} failed: {exc}") from exc
        return _DescribedWork(work, what) if async_op else work

    def all_gather_object(self, obj: Any, *, label: str = "") -> list:
        """Every rank's picklable ``obj``, in rank order (small metadata only). With
        ``debug``, logged and named (with ``label``) in any error."""
        out: list = [None] * self.world_size
        self.ledger.calls["all_gather_object"] += 1
        if not self.debug:
            dist.all_gather_object(out, obj, group=self.group)
            return out
        what = f"rank {self.rank}: all_gather_object" + (f" for {label}" if label else "")
        logger.debug("%s", what)
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as exc:
            raise CollectiveError(f"{what} failed: {exc}") from exc
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class _DescribedWork:
    """An async work handle whose ``wait()`` failure names the collective."""

    def __init__(self, work, what: str) -> None:
        self._work = work
        self._what = what
        self.count = getattr(work, "count", 1)   # launches (all_gather_into_many)

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except Exception as exc:
            raise CollectiveError(f"{self._what} failed: {exc}") from exc

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _drop_coalescing_state(group: Optional[dist.ProcessGroup]) -> None:
    """Forget gathers a failed coalescing manager left collected: torch clears them only
    when the block ends normally, and later calls on the group would be collected too."""
    c10d = dist.distributed_c10d
    pending = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
    if pending is not None:
        pending.pop(group if group is not None else c10d._get_default_group(), None)


class _Launches:
    """Async works launched together; ``wait()`` waits for all of them. Keeps the inputs
    alive until then (a device copy of a host shard has no other owner)."""

    def __init__(self, works: list, count: int, inputs: Sequence[torch.Tensor]) -> None:
        self._works = [w for w in works if w is not None]
        self.count = count
        self._inputs: Optional[Sequence[torch.Tensor]] = inputs

    def wait(self, *args, **kwargs) -> bool:
        for work in self._works:
            work.wait(*args, **kwargs)
        self._inputs = None
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _describe(backends: Mapping[str, str]) -> str:
    return ",".join(f"{device}:{name}" for device, name in backends.items())


def _reduce_op(name: str) -> dist.ReduceOp:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "avg": dist.ReduceOp.AVG}
    if name not in ops:
        raise ValueError(f"unknown reduce op {name!r}; expected one of {sorted(ops)}")
    return ops[name]


# =========================================================================================
# DeepSpeed's ``deepspeed.comm`` functions, for scripts that call them directly
# (``import deepspeed.comm as dist``; ``dist.get_rank()``, ``dist.all_reduce(t)``). They act
# on the default process group (or ``group``) like their torch.distributed namesakes; the
# extra keyword arguments of DeepSpeed's versions (``prof``, ``log_name``, ``debug``) are
# accepted and ignored. Every rank of the group must call a collective, in the same order.
# =========================================================================================
ReduceOp = dist.ReduceOp


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _require_group(name: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"comm.{name}() needs the process group: call "
                           "zerotrain.init_distributed() (deepspeed.init_distributed()) or "
                           "zerotrain.initialize() first")


def get_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    _require_group("get_rank")
    return dist.get_rank(group)


def get_world_size(group: Optional[dist.ProcessGroup] = None) -> int:
    """The number of ranks in ``group`` (default: the world)."""
    _require_group("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """The rank on this node, from ``LOCAL_RANK`` (set by torchrun and ``zerotrain launch``)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Optional[dist.ProcessGroup] = None, group_rank: int = 0) -> int:
    """The world rank of rank ``group_rank`` of ``group``."""
    _require_group("get_global_rank")
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def get_world_group() -> dist.ProcessGroup:
    _require_group("get_world_group")
    return dist.group.WORLD


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of ``ranks`` (every rank of the world must call it)."""
    _require_group("new_group")
    return dist.new_group(ranks)


def get_backend(group: Optional[dist.ProcessGroup] = None) -> str:
    _require_group("get_backend")
    return dist.get_backend(group)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def barrier(group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
            device_ids: Any = None, **_: Any):
    """Wait until every rank of ``group`` reaches this call."""
    _require_group("barrier")
    return dist.barrier(group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM,
               group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **_: Any):
    """Reduce ``tensor`` in place over the ranks of ``group`` (``op``: a ``ReduceOp``)."""
    _require_group("all_reduce")
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Optional[dist.ProcessGroup] = None,
              async_op: bool = False, **_: Any):
    """Overwrite ``tensor`` on every rank with world rank ``src``'s."""
    _require_group("broadcast")
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM,
           group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **_: Any):
    """Reduce ``tensor`` into world rank ``dst``'s copy."""
    _require_group("reduce")
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
               group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **_: Any):
    """Every rank's ``tensor`` into ``tensor_list``, in rank order (equal sizes on gloo)."""
    _require_group("all_gather")
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
                           **_: Any):
    """Every rank's ``input_tensor`` concatenated into ``output_tensor`` in rank order."""
    _require_group("all_gather_into_tensor")
    return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                          op: Any = ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None,
                          async_op: bool = False, **_: Any):
    """Sum ``input_tensor`` over ranks; rank r keeps slice r in ``output_tensor``."""
    _require_group("reduce_scatter_tensor")
    if op != ReduceOp.SUM:
        raise ValueError(f"comm.reduce_scatter_tensor supports op=ReduceOp.SUM, got {op}")
    return _reduce_scatter(output_tensor, input_tensor, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor,
                      output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None,
                      group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
                      **_: Any):
    _require_group("all_to_all_single")
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)


def destroy_process_group(group: Optional[dist.ProcessGroup] = None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)
