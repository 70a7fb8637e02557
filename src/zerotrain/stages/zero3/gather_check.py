"""The stage-3 gather check: every unit gather carries 16 bytes saying which unit it is.

Note: gather check
    Ranks must gather the same units in the same order. When they do not (data-dependent
    routing into experts that are units of their own, a module run on some ranks only, an
    extra forward on one rank), two gathers of the same size pair up and each rank builds
    a parameter out of another unit's shards: training goes on, wrong. So each unit gather
    carries a header of 16 bytes per rank, inside the gather itself (no collective of its
    own): a magic word, the unit's index, the forward pass (counted since the stage was
    built) and the gather's place in that pass. After the gather every rank holds every
    rank's header; if any differs from its own, every rank raises
    :class:`~zerotrain.errors.RankDivergenceError` at that same gather, naming the pass and
    the unit (module) each rank was at, and what to do.

    On a device (NCCL) a unit is one flat all-gather, ``[header | shard]`` per rank, whose
    result is copied out into the parameters' segments (FSDP2's copy-out): the header costs
    16 bytes per rank and no launch. On the host (gloo) the payload gathers go out one by
    one, in place (Note "coalesced gathers" in ``comm/coalesced.py``), and the header
    goes first, alone, and is checked before they launch: gloo aborts the process (SIGABRT,
    no exception) when two ranks' gathers differ in size, which is what two different
    units usually are, so nothing of a unit may launch before the ranks agree on it. That
    is one more small launch and a round trip per unit on the host (docs/BENCHMARKS.md),
    paid until the ranks agree on a launch plan, after which a cycle that follows it sends
    no header at all (Note "launch plans" in ``plan.py``). qwZ's int8 gathers carry no
    header.

Note: held reductions
    On the host a gather is not the only collective that can meet another rank's
    different one: once a trace exists, prefetch and reuse leave a rank's backward starting
    with a gradient reduce-scatter, which an extra forward (or a skipped module) on another
    rank meets with a gather. Gloo pairs neither (a different operation waits out
    ``comms_timeout``), and no payload can say what it is. So on the host every stage-3
    collective of forward, backward and step starts with the same 16-byte header: the
    plain gradient reduce-scatters (:class:`HostLaunches`, the stage's ``reduce_scatter``)
    are held, not launched, until the next header goes out (the next unit gather, or the
    first wait on one of them, or the step), which names them too (how many; the unit it
    goes out with, if any), and are launched once the ranks agree. The step's gradient
    norm all-reduce gets a header of its own. The first collective in which ranks differ
    is then always a header, and every rank raises there. Holding a reduction costs no
    overlap: it goes out at the next unit's gather, which in backward follows right after.
    A header per step and per backward's held tail are the only ones added to the unit
    gathers'. MiCS's and qgZ's reductions (``hierarchy.py``) go out as before, unheld.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from ...comm import Communicator
from ...errors import RankDivergenceError

HEADER_BYTES = 16
MAGIC = 0x5A543347   # 'ZT3G'
NO_UNIT = -1         # a header that goes out with no unit gather (held reductions only)
STEP = -2            # the header of an optimizer step
CALLS = {-3: "save_checkpoint", -4: "load_checkpoint"}   # headers of collective engine calls


class GatherCheck:
    """What this rank's next unit gather says about itself, and the check of what came back.
    One per wire; every rank builds the same one."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled   # False where collectives carry no data (a traced world)
        self.forward_pass = 0
        self.sequence = 0     # unit gathers in this pass
        self._describe: Callable[[int], str] = lambda index: f"unit {index}"

    def describe_units_with(self, describe: Callable[[int], str]) -> None:
        """How a unit index reads in an error (the stage knows its units' modules)."""
        self._describe = describe

    def describe(self, unit_index: int) -> str:
        return self._describe(unit_index)

    def begin_pass(self) -> None:
        """A forward of the whole model starts."""
        self.forward_pass += 1
        self.sequence = 0

    def next_header(self, unit_index: int, reductions: int = 0) -> list[int]:
        """The header of this rank's next launch: ``unit_index`` (or NO_UNIT, STEP) and the
        ``reductions`` held until it (Note: held reductions), in the low and high half of
        the last word."""
        header = [MAGIC, unit_index, self.forward_pass,
                  (self.sequence & 0xFFFF) | (min(reductions, 0x7FFF) << 16)]
        self.sequence += 1
        return header

    def verify(self, headers: torch.Tensor, mine: Sequence[int], rank: int) -> None:
        """``headers``: int32 ``(world, 4)``, every rank's; raise on every rank alike when
        one differs from this rank's ``mine`` (Note: gather check)."""
        if not self.enabled:
            return
        rows = headers.tolist()
        if all(row == list(mine) for row in rows):
            return
        raise RankDivergenceError(self._message(rows, rank))

    def _message(self, rows: list[list[int]], rank: int) -> str:
        def where(row: list[int]) -> str:
            if row[0] != MAGIC:
                return "not a unit gather (a different collective paired with it)"
            unit, passes, launch, held = row[1], row[2], row[3] & 0xFFFF, row[3] >> 16
            if unit in CALLS:
                return f"{CALLS[unit]}() after forward pass {passes}"
            reduced = (f"{held} gradient reduce-scatter{'s' if held != 1 else ''}"
                       if held else "")
            if unit == STEP:
                what = "the optimizer step" + (f" after {reduced}" if held else "")
                return f"{what}, after forward pass {passes}"
            if unit == NO_UNIT:
                return f"{reduced} in the backward of forward pass {passes} (launch {launch})"
            after = f" after {reduced}" if held else ""
            return f"{self._describe(unit)}{after}, gather {launch} of forward pass {passes}"
        lines = "; ".join(f"rank {r}: {where(row)}" for r, row in enumerate(rows))
        calls = sorted({CALLS[row[1]] for row in rows if row[0] == MAGIC and row[1] in CALLS})
        if calls:
            return (f"rank {rank}: stage 3: ranks are launching different collectives "
                    f"({lines}). {' and '.join(c + '()' for c in calls)} is collective: every "
                    "rank calls it at the same point (a call under `if rank == 0:` is the "
                    "usual cause); see docs/divergence.md")
        return (f"rank {rank}: stage 3: ranks are launching different collectives ({lines}). "
                "The ranks took different paths through the model: routing that depends "
                "on the data (experts that are units of their own), a module run on some "
                "ranks only, or a forward on one rank only. Declare the block that routes "
                "a leaf module (zerotrain.utils.set_z3_leaf_modules(model, [BlockClass]) "
                "before initialize, or zero_optimization.leaf_module.classes), or raise "
                "zero_optimization.stage3_param_persistence_threshold above its "
                "parameters' sizes so they stay gathered; run the same modules on every "
                "rank otherwise")


def header_numel(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that hold the header."""
    size = torch.empty((), dtype=dtype).element_size()
    return max(1, HEADER_BYTES // size)


def _write_header(flat: torch.Tensor, h: int, header: Sequence[int]) -> None:
    flat[:h].view(torch.uint8)[:HEADER_BYTES].copy_(
        torch.tensor(header, dtype=torch.int32).view(torch.uint8))


def _read_headers(rows: torch.Tensor, h: int) -> torch.Tensor:
    """Every rank's header, int32 ``(world, 4)``, from the gathered ``rows``."""
    raw = rows[:, :h].to("cpu").contiguous().view(torch.uint8)[:, :HEADER_BYTES]
    return raw.contiguous().view(torch.int32)


class CheckedGathering:
    """A gather that carried headers into ``rows`` (``world x (h + n)``); ``wait()`` checks
    them, then copies each piece's columns out into its place."""

    def __init__(self, work, rows: torch.Tensor, h: int, header: list[int],
                 pieces: Sequence[tuple[Union[int, torch.SymInt], int, torch.Tensor]],
                 comm: Communicator,
                 check: GatherCheck, keep: torch.Tensor) -> None:
        self._work, self._rows, self._h, self._header = work, rows, h, header
        self._pieces = pieces   # (column after the header, chunk, output of world*chunk)
        self._comm, self._check = comm, check
        # the input, alive until the gather is done
        self._keep: Optional[torch.Tensor] = keep

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._check.verify(_read_headers(self._rows, self._h), self._header, self._comm.rank)
        with torch.no_grad():
            for column, chunk, output in self._pieces:
                output.view(self._comm.world_size, chunk).copy_(
                    self._rows[:, self._h + column: self._h + column + chunk])
        self._keep = None


class HostLaunches:
    """The host's checked launches over one group (Note: held reductions): the headers,
    and the gradient reduce-scatters held until the next one."""

    def __init__(self, comm: Communicator, check: GatherCheck) -> None:
        self.comm, self.check = comm, check
        self._held: list[_HeldReduction] = []
        self._failed: Optional[RankDivergenceError] = None
        # per dtype: this rank's header and every rank's, reused (the gather is synchronous)
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.plan = None   # a LaunchPlan (Note "launch plans" in plan.py), where usable

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       async_op: bool = False, label: str = ""):
        """``Communicator.reduce_scatter``, held until the next header goes out; as it is
        when the cycle's plan has it next (Note "launch plans" in plan.py)."""
        if self._admitted(("reduce-scatter", input.numel(), str(input.dtype)),
                          lambda: f"a gradient reduce-scatter of {input.numel()} elements "
                          f"in the backward of forward pass {self.check.forward_pass}"):
            return self.comm.reduce_scatter(output, input, async_op=async_op, label=label)
        held = _HeldReduction(self, output, input, label)
        self._held.append(held)
        if async_op:
            return held
        held.wait()
        return None

    def before_gather(self, unit_index: int, *, dtype: torch.dtype, label: str) -> None:
        """Before the unit's gathers launch: nothing when the cycle's plan has them next
        (Note "launch plans" in plan.py), else the header (``agree``)."""
        if self._admitted(("gather", unit_index),
                          lambda: f"{self.check.describe(unit_index)}, gather "
                          f"{self.check.sequence} of forward pass {self.check.forward_pass}"):
            self.check.sequence += 1
            return
        self.agree(unit_index, dtype=dtype, label=label)

    def before_step(self, *, label: str) -> None:
        """Before the step's all-reduce: the header (none when the plan has the step
        next), then the cycle's record into the trail (Note "launch plans" in plan.py)."""
        if not self._admitted(("step",), lambda: "the optimizer step after forward pass "
                                                 f"{self.check.forward_pass}"):
            self.agree(STEP, label=label)
        if self.plan is not None:
            self.plan.end_cycle()

    def before_call(self, code: int) -> None:
        """Before a collective engine call (``code``: a key of :data:`CALLS`): leave a
        standing plan (Note "launch plans" in plan.py), then exchange a header naming the
        call, so a peer at a unit gather or the step raises with this rank, at once."""
        if self._failed is not None:
            raise self._failed
        if self.plan is not None:
            try:
                self.plan.leave_for(f"{CALLS[code]}() after forward pass "
                                    f"{self.check.forward_pass}")
            except RankDivergenceError as exc:
                self.failed(exc)
                raise
        self.agree(code, label=CALLS[code])

    def failed(self, error: RankDivergenceError) -> None:
        """The ranks were found apart elsewhere (the step): no collective pairs any more."""
        self._failed = error
        if self.plan is not None:
            self.plan.forget()

    def _admitted(self, op: tuple, actual: Callable[[], str]) -> bool:
        if self._failed is not None:
            raise self._failed
        if self.plan is None:
            return False
        try:
            return self.plan.admit(op, actual)
        except RankDivergenceError as exc:
            self.failed(exc)
            raise

    def agree(self, unit_index: int, *, dtype: torch.dtype = torch.float32,
              label: str = "") -> None:
        """Exchange this rank's header (``unit_index``: the unit gathered next, NO_UNIT or
        STEP; the held reductions) and raise on every rank if any differs; then launch the
        held reductions. Nothing to say (no unit, nothing held) exchanges nothing."""
        if self._failed is not None:   # the ranks are apart: no collective pairs any more
            raise self._failed
        if unit_index == NO_UNIT and not self._held:
            return
        header = self.check.next_header(unit_index, len(self._held))
        h = header_numel(dtype)
        flat, rows = self._buffers_of(dtype, h)
        _write_header(flat, h, header)
        self.comm.all_gather(rows.view(-1), flat, label=f"{label or 'held reductions'} "
                             "(check)", carried=h)
        try:
            self.check.verify(_read_headers(rows, h), header, self.comm.rank)
        except RankDivergenceError as exc:
            self._failed = exc
            raise
        held, self._held = self._held, []
        for reduction in held:
            reduction.launch()


    def _buffers_of(self, dtype: torch.dtype, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        buffers = self._buffers.get(dtype)
        if buffers is None:
            buffers = self._buffers[dtype] = (
                torch.zeros(h, dtype=dtype), torch.empty(self.comm.world_size, h, dtype=dtype))
        return buffers


class _HeldReduction:
    """A gradient reduce-scatter held until the next header (Note: held reductions);
    ``wait()`` sends that header first if it has not gone out yet."""

    __slots__ = ("_owner", "_args", "_work")

    def __init__(self, owner: HostLaunches, output: torch.Tensor, input: torch.Tensor,
                 label: str) -> None:
        self._owner, self._work = owner, None
        self._args: Optional[tuple[torch.Tensor, torch.Tensor, str]] = (output, input, label)

    def launch(self) -> None:
        assert self._args is not None   # launched once: the owner empties its held list first
        output, input, label = self._args
        self._work = self._owner.comm.reduce_scatter(output, input, async_op=True,
                                                     label=label)
        self._args = None

    def wait(self, *args, **kwargs):
        if self._work is None:
            self._owner.agree(NO_UNIT)
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work is not None and self._work.is_completed()


def start_checked(comm: Communicator, check: GatherCheck, unit_index: int,
                  shard: torch.Tensor, outputs: Sequence[torch.Tensor],
                  inputs: Sequence[torch.Tensor], *, label: str,
                  host: Optional[HostLaunches] = None) -> list:
    """Launch a unit's gathers of ``inputs`` (views of ``shard``) into ``outputs`` with the
    header (Note: gather check); ``host`` is the group's :class:`HostLaunches` (the header
    goes out through it on the host). Returns the gatherings in launch order."""
    if not outputs:
        return []
    if not comm.gathers_flat(shard.device):   # host: the header alone, checked first
        host = host or HostLaunches(comm, check)
        host.before_gather(unit_index, dtype=shard.dtype, label=label)
        return [comm.all_gather_into_many(outputs, inputs, label=label)]
    header = check.next_header(unit_index)
    h = header_numel(shard.dtype)
    base = shard.storage_offset()   # device: one flat gather, every piece after the header
    carried = [(i.storage_offset() - base, i.numel(), o) for i, o in zip(inputs, outputs)]
    numel = max(c + n for c, n, _ in carried)
    flat = torch.empty(h + numel, dtype=shard.dtype, device=shard.device)
    flat[h:].copy_(shard[:numel])
    _write_header(flat, h, header)
    rows = torch.empty(comm.world_size, flat.numel(), dtype=flat.dtype, device=flat.device)
    work = comm.all_gather(rows.view(-1), flat, async_op=True, label=label, carried=h)
    return [CheckedGathering(work, rows, h, header, carried, comm, check, flat)]
