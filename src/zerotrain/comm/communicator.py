"""The :class:`Communicator`: the one place zerotrain's own collectives are launched.

Why a module of its own: every collective zerotrain runs (gradient reduction, stage-3
gathers, checkpoint agreement, ZeRO++'s two-level schemes) goes through one object that
checks where its tensors are, records them in a :class:`~zerotrain.comm.ledger.CommLedger`,
and names the collective in any error (Note "named failures" in ``failures.py``), so
nothing reaches torch.distributed unchecked or uncounted.

Note: collective devices
    Every tensor handed to a collective must be on a device the group's backend serves, and
    a CUDA tensor on the current device (NCCL would otherwise fail deep inside, or hang).
    :class:`Communicator` checks this before each call; the check is a few comparisons, so
    it is always on and every distributed test runs its collectives through it.

Note: public launch points
    Each collective a :class:`Communicator` launches goes through the ``zerotrain.comm``
    function of its family (``deepspeed.comm``'s through the switch), looked up when it
    launches: ``all_reduce``, ``reduce_scatter_fn``, ``allgather_fn``, ``broadcast``,
    ``all_to_all_single``, ``barrier``, ``all_gather_object``. DeepSpeed's stages call
    those names, so scripts wrap them (a profiler, a fault injector, a collective count);
    here a wrapper set on one of them sees zerotrain's own collectives as well. The checks,
    the ledger and the trail stay here, before the call: a wrapper changes what runs, never
    what is counted. Only gathers that go out together inside torch's coalescing manager
    (a device: Note "coalesced gathers" in ``coalesced.py``) launch directly: the manager
    collects the calls
    rather than running them, so a wrapper there could break the group call; gathered
    one by one (the host), each goes through ``allgather_fn``.

Note: a traced world
    The memory planner (``planner/``) runs one rank of a world over torch's fake process
    group (backend ``fake``), on fake tensors: its collectives return at once and carry no
    data. :attr:`Communicator.carries_data` is False there, and what reads a collective's
    values to check the ranks against each other (the step fingerprint, the stage-3 gather
    headers) skips the check: one rank is traced, so there is nobody to disagree with;
    :meth:`Communicator.all_gather_object` answers this rank's object for every rank, as the
    ranks of a symmetric run would.
"""
from __future__ import annotations

import copy
import logging
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from .coalesced import _Launches, coalescable, launch_gathers
from .failures import _DescribedWork, _Failure
from .topology import Topology, group_of, local_node_entry
from .ledger import CommLedger
from .setup import group_backends, group_timeout

logger = logging.getLogger(__name__)

# torch 2.13 renames the tensor collectives; torch 2.4 only has the old names (the
# all-gather's twin is in coalesced.py, which launches it).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _public(name: str) -> Callable:
    """``zerotrain.comm.<name>`` as it is bound now (Note: public launch points)."""
    return getattr(sys.modules[__package__], name)


# Process groups are costly to create and never freed by torch before shutdown: each
# partition gets its group once per process (keyed by the default group it was made from).
# The key holds the default group's id(), which a later default group may reuse once the
# first is destroyed; the entry therefore keeps that group itself, and a hit made from
# another default group is a miss (a subgroup of a destroyed world is dead).
_SUBGROUPS: dict[tuple, tuple[Any, dist.ProcessGroup]] = {}


class Communicator:
    """Collectives over one process group, each recorded in ``ledger``.

    Every method must be called by all ranks of the group in the same order. Methods with
    ``async_op=True`` return a work handle whose ``wait()`` must be called before the result
    is read; otherwise they return None.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, debug: bool = False,
                 topology: Optional[Topology] = None,
                 ledger: Optional[CommLedger] = None,
                 unread: Optional[list[Callable[[], None]]] = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ledger = CommLedger() if ledger is None else ledger
        self.debug = debug
        self.backends = group_backends(group)
        # False over torch's fake process group (Note: a traced world)
        self.carries_data = "fake" not in self.backends.values()
        self.ranks: tuple[int, ...] = (tuple(dist.get_process_group_ranks(group))
                                       if group is not None else tuple(range(self.world_size)))
        self.topology = topology or Topology.single_node(dist.get_rank(),
                                                         dist.get_world_size())
        self.reach = "cross_node" if self.topology.spans_nodes(self.ranks) else "intra_node"
        # until the backend refuses (Note "coalesced gathers" in coalesced.py)
        self._coalesce = True
        # verdicts to read before the next launch, shared with the communicators made from
        # this one (Note "deferred verdicts" in agreement.py)
        self._unread: list[Callable[[], None]] = [] if unread is None else unread
        # the error of a vote that stopped the ranks (its verdict, or the vote's failure):
        # after it nothing more is to be launched (Note "deferred verdicts" in agreement.py)
        self.stopped_by_vote: Optional[BaseException] = None
        # the engine's plan of the cycle's votes (Note "vote plans" in engine/vote_plan.py):
        # the step's all-reduce ends its cycle; None where no plan is kept
        self.vote_plan: Any = None

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
                            ledger=self.ledger, unread=self._unread)

    def subgroup(self, partition: Sequence[Sequence[int]]) -> "Communicator":
        """The group of ``partition`` (global rank lists) holding this rank, recording into
        this communicator's ledger. Collective over the default group the first time a
        partition is asked for (every rank must ask for the same partitions in the same
        order); created once per process and reused after."""
        key = (id(dist.group.WORLD), tuple(tuple(ranks) for ranks in partition))
        group_of(key[1], dist.get_rank())   # raises if the partition misses this rank
        world, group = _SUBGROUPS.get(key, (None, None))
        if group is None or world is not dist.group.WORLD:
            group, _ = dist.new_subgroups_by_enumeration([list(r) for r in key[1]],
                                                         timeout=group_timeout())
            _SUBGROUPS[key] = (dist.group.WORLD, group)
        return Communicator(group, debug=self.debug, topology=self.topology,
                            ledger=self.ledger, unread=self._unread)

    def defer(self, read: Callable[[], None]) -> None:
        """Run ``read`` (a vote's verdict, which may raise) just before the next collective
        this communicator, or one sharing its list, launches (Note "deferred verdicts" in
        ``agreement.py``)."""
        self._unread.append(read)

    def read_deferred(self) -> None:
        """Run what :meth:`defer` holds now, in order; each is taken off first, so that the
        collectives it runs launch without reading it again."""
        while self._unread:
            self._unread.pop(0)()

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
                   label: str = "", carried: int = 0):
        """In-place reduction of ``tensor`` over all ranks (``op``: sum, max, min, avg);
        ``carried`` of its elements are a check's, counted apart in the ledger."""
        self.check_devices("all_reduce", label, tensor)
        self.ledger.record("all_reduce", tensor, factor=2, reach=self.reach, carried=carried)
        return self._call("all_reduce", tensor, label, async_op,
                          lambda: _public("all_reduce")(tensor, op=_reduce_op(op),
                                                        group=self.group, async_op=async_op),
                          detail=op if carried < tensor.numel() else "check")

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       async_op: bool = False, label: str = ""):
        """Sum ``input`` (``world * n`` elements) over ranks; rank r gets slice r in ``output``."""
        self._check_world_sized("reduce_scatter input", input, output)
        self.check_devices("reduce_scatter", label, output, input)
        self.ledger.record("reduce_scatter", input, reach=self.reach)
        return self._call("reduce_scatter", input, label, async_op,
                          lambda: _public("reduce_scatter_fn")(output, input, group=self.group,
                                                               async_op=async_op))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   label: str = "", carried: int = 0):
        """Concatenate every rank's ``input`` (``n`` elements) into ``output`` in rank order;
        ``carried`` elements of each rank's input are a check's header (counted apart)."""
        self._check_world_sized("all_gather output", output, input)
        self.check_devices("all_gather", label, output, input)
        self.ledger.record("all_gather", output, reach=self.reach,
                           carried=carried * self.world_size)
        return self._call("all_gather", output, label, async_op,
                          lambda: _public("allgather_fn")(output, input, group=self.group,
                                                          async_op=async_op))

    def all_gather_into_many(self, outputs: Sequence[torch.Tensor],
                             inputs: Sequence[torch.Tensor], *, label: str = ""):
        """All-gathers of several tensors launched together, asynchronously: every rank's
        ``inputs[i]`` (``n_i`` elements) concatenated in rank order into ``outputs[i]``
        (``world * n_i`` elements, written in place: views of one buffer are fine). One
        launch on a device, one per gather on the host (Note "coalesced gathers" in
        ``coalesced.py``). Bytes are counted as ``all_gather``'s, the outputs', and calls
        as the launches made.
        Returns a handle whose ``wait()`` must be called before the outputs are read; all
        ranks call it with the same sizes in the same order."""
        if len(outputs) != len(inputs):
            raise ValueError(f"all_gather_into_many got {len(outputs)} outputs for "
                             f"{len(inputs)} inputs")
        for i, (output, input) in enumerate(zip(outputs, inputs)):
            self._check_world_sized(f"all_gather_into_many output {i}", output, input)
        self.check_devices("all_gather", label, *outputs, *inputs)
        if self._unread:
            self.read_deferred()
        failure = _Failure(self, "all_gather", outputs[0] if outputs else None, label,
                           count=len(outputs))
        if self.debug:   # the element count costs a pass over the outputs: debug only
            failure.elements = sum(o.numel() for o in outputs)
            logger.debug("%s", failure.what())
        self.ledger.trail.note("all_gather", len(outputs), label)
        if self.ledger.launches is not None:   # Note "vote plans" in engine/vote_plan.py
            self.ledger.launches(self, "all_gather_into_many", None, "")
        try:
            launches = self._gather_many(outputs, inputs)
        except Exception as exc:
            raise failure.error(exc) from exc
        self.ledger.record_many("all_gather", outputs, calls=launches.count, reach=self.reach)
        return _DescribedWork(launches, failure)

    def gathers_flat(self, device: torch.device) -> bool:
        """Whether a unit of many tensors on ``device`` is gathered as one flat all-gather
        (a device backend, NCCL: one launch, copied out after) rather than one gather per
        tensor in place (the host: Note "coalesced gathers" in ``coalesced.py``). The same
        on every rank."""
        return device.type != "cpu"

    def _check_world_sized(self, what: str, whole: torch.Tensor, part: torch.Tensor) -> None:
        """``whole`` must hold one ``part`` per rank of the group."""
        if whole.numel() != part.numel() * self.world_size:
            raise ValueError(f"{what} has {whole.numel()} elements, expected "
                             f"{self.world_size} x {part.numel()}")

    def _gather_many(self, outputs: Sequence[torch.Tensor],
                     inputs: Sequence[torch.Tensor]) -> _Launches:
        """Launch the gathers (Note "coalesced gathers" in ``coalesced.py``); a refused
        coalesced call is logged once and not tried again."""
        launches, refused = launch_gathers(outputs, inputs, self.group,
                                           coalesce=self._coalesces(outputs))
        if refused is not None:
            logger.info("coalesced all-gather unavailable (%s); gathering one by one", refused)
            self._coalesce = False
        return launches

    def _coalesces(self, outputs: Sequence[torch.Tensor]) -> bool:
        """Whether these gathers go out as one launch (Note "coalesced gathers" in
        ``coalesced.py``)."""
        return self._coalesce and coalescable(outputs)

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, async_op: bool = False,
                  label: str = ""):
        """Overwrite ``tensor`` on every rank with rank ``src``'s (a global rank)."""
        self.check_devices("broadcast", label, tensor)
        self.ledger.record("broadcast", tensor, reach=self.reach)
        return self._call("broadcast", tensor, label, async_op,
                          lambda: _public("broadcast")(tensor, src=src, group=self.group,
                                                       async_op=async_op))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   label: str = ""):
        """Rank r's ``input`` is cut into ``world`` equal parts; part j goes to rank j, which
        stores it as part r of its ``output`` (same sizes)."""
        if input.numel() != output.numel() or input.numel() % self.world_size:
            raise ValueError(f"all_to_all needs equal input and output sizes divisible by "
                             f"{self.world_size}, got {input.numel()} and {output.numel()}")
        self.check_devices("all_to_all", label, output, input)
        self.ledger.record("all_to_all", input, reach=self.reach)
        return self._call("all_to_all", input, label, async_op,
                          lambda: _public("all_to_all_single")(output, input, group=self.group,
                                                               async_op=async_op))

    def all_to_all_uneven(self, output: torch.Tensor, input: torch.Tensor,
                          output_splits: Sequence[int], input_splits: Sequence[int], *,
                          total: int, label: str = "") -> None:
        """Rank r sends ``input_splits[j]`` elements of ``input`` (in rank order) to rank j
        and receives ``output_splits[j]`` from rank j into ``output``; every pair of ranks
        must agree on the sizes they exchange. ``total``: the elements all ranks send
        together (the same on every rank: the divergence check compares it). Counted as
        ``all_to_all``, by the input."""
        if (len(output_splits) != self.world_size or len(input_splits) != self.world_size
                or sum(output_splits) != output.numel() or sum(input_splits) != input.numel()):
            raise ValueError(f"all_to_all_uneven needs {self.world_size} splits summing to "
                             f"the tensors' sizes, got {list(input_splits)} for "
                             f"{input.numel()} and {list(output_splits)} for {output.numel()}")
        self.check_devices("all_to_all", label, output, input)
        self.ledger.record("all_to_all", input, reach=self.reach)
        if self._unread:
            self.read_deferred()
        # the step's trail compares ranks: it notes what every rank agrees on, the total
        self.ledger.trail.note("all_to_all", total, label)
        try:
            _public("all_to_all_single")(output, input, output_split_sizes=list(output_splits),
                                         input_split_sizes=list(input_splits),
                                         group=self.group)
        except Exception as exc:
            raise _Failure(self, "all_to_all", input, label).error(exc) from exc

    def _call(self, op: str, tensor: Optional[torch.Tensor], label: str, async_op: bool,
              launch, detail: str = ""):
        """Run a collective; name it in any error (Note: named failures), and with ``debug``
        log it first. A deferred verdict is read first; a vote plan's recorder is told."""
        if self._unread:
            self.read_deferred()
        self.ledger.trail.note(op, None if tensor is None else tensor.numel(), label)
        if self.ledger.launches is not None:   # Note "vote plans" in engine/vote_plan.py
            self.ledger.launches(self, op, tensor, detail)
        if self.debug:
            logger.debug("%s", _Failure(self, op, tensor, label).what())
        try:
            work = launch()
        except Exception as exc:
            raise _Failure(self, op, tensor, label).error(exc) from exc
        return _DescribedWork(work, (self, op, tensor, label)) if async_op else work

    def all_gather_object(self, obj: Any, *, label: str = "") -> list:
        """Every rank's picklable ``obj``, in rank order (small metadata only); named (with
        ``label``) in any error, and with ``debug`` logged."""
        if not self.carries_data:   # Note: a traced world
            return [copy.deepcopy(obj) for _ in range(self.world_size)]
        out: list = [None] * self.world_size
        self.ledger.calls["all_gather_object"] += 1
        self._call("all_gather_object", None, label, False,
                   lambda: _public("all_gather_object")(out, obj, group=self.group))
        return out

    def barrier(self, *, label: str = "") -> None:
        """Wait until every rank of the group arrives; named (with ``label``) in any error."""
        self._call("barrier", None, label, False,
                   lambda: _public("barrier")(group=self.group))


def _describe(backends: Mapping[str, str]) -> str:
    return ",".join(f"{device}:{name}" for device, name in backends.items())


def _reduce_op(name: str) -> dist.ReduceOp.RedOpType:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "avg": dist.ReduceOp.AVG}
    if name not in ops:
        raise ValueError(f"unknown reduce op {name!r}; expected one of {sorted(ops)}")
    return ops[name]
