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
    one, in place (Note "coalesced gathers" in ``comm/communicator.py``), and the header
    goes first, alone, and is checked before they launch: gloo aborts the process (SIGABRT,
    no exception) when two ranks' gathers differ in size, which is what two different
    units usually are, so nothing of a unit may launch before the ranks agree on it. That
    is one more small launch and a round trip per unit on the host (docs/BENCHMARKS.md).
    qwZ's int8 gathers carry no header.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...comm import Communicator
from ...errors import RankDivergenceError

HEADER_BYTES = 16
MAGIC = 0x5A543347   # 'ZT3G'


class GatherCheck:
    """What this rank's next unit gather says about itself, and the check of what came back.
    One per wire; every rank builds the same one."""

    def __init__(self) -> None:
        self.forward_pass = 0
        self.sequence = 0     # unit gathers in this pass
        self._describe: Callable[[int], str] = lambda index: f"unit {index}"

    def describe_units_with(self, describe: Callable[[int], str]) -> None:
        """How a unit index reads in an error (the stage knows its units' modules)."""
        self._describe = describe

    def begin_pass(self) -> None:
        """A forward of the whole model starts."""
        self.forward_pass += 1
        self.sequence = 0

    def next_header(self, unit_index: int) -> list[int]:
        header = [MAGIC, unit_index, self.forward_pass, self.sequence]
        self.sequence += 1
        return header

    def verify(self, headers: torch.Tensor, mine: Sequence[int], rank: int) -> None:
        """``headers``: int32 ``(world, 4)``, every rank's; raise on every rank alike when
        one differs from this rank's ``mine`` (Note: gather check)."""
        rows = headers.tolist()
        if all(row == list(mine) for row in rows):
            return
        raise RankDivergenceError(self._message(rows, rank))

    def _message(self, rows: list[list[int]], rank: int) -> str:
        def where(row: list[int]) -> str:
            if row[0] != MAGIC:
                return "not a unit gather (a different collective paired with it)"
            return (f"{self._describe(row[1])}, gather {row[3]} of forward pass {row[2]}")
        lines = "; ".join(f"rank {r}: {where(row)}" for r, row in enumerate(rows))
        return (f"rank {rank}: stage 3: ranks are gathering different units ({lines}). "
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
                 pieces: Sequence[tuple[int, int, torch.Tensor]], comm: Communicator,
                 check: GatherCheck, keep: torch.Tensor) -> None:
        self._work, self._rows, self._h, self._header = work, rows, h, header
        self._pieces = pieces   # (column after the header, chunk, output of world*chunk)
        self._comm, self._check = comm, check
        self._keep = keep       # the input, alive until the gather is done

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


def start_checked(comm: Communicator, check: GatherCheck, unit_index: int,
                  shard: torch.Tensor, outputs: Sequence[torch.Tensor],
                  inputs: Sequence[torch.Tensor], *, label: str) -> list:
    """Launch a unit's gathers of ``inputs`` (views of ``shard``) into ``outputs`` with the
    header (Note: gather check); returns the gatherings in launch order."""
    if not outputs:
        return []
    header = check.next_header(unit_index)
    h = header_numel(shard.dtype)
    if not comm.gathers_flat(shard.device):   # host: the header alone, checked first
        flat = torch.empty(h, dtype=shard.dtype, device=shard.device)
        _write_header(flat, h, header)
        rows = torch.empty(comm.world_size, h, dtype=flat.dtype, device=flat.device)
        comm.all_gather(rows.view(-1), flat, label=f"{label} (check)", carried=h)
        check.verify(_read_headers(rows, h), header, comm.rank)
        return [comm.all_gather_into_many(outputs, inputs, label=label)]
    base = shard.storage_offset()   # device: one flat gather, every piece after the header
    carried = [(i.storage_offset() - base, i.numel(), o) for i, o in zip(inputs, outputs)]
    numel = max(c + n for c, n, _ in carried)
    flat = torch.empty(h + numel, dtype=shard.dtype, device=shard.device)
    flat[h:].copy_(shard[:numel])
    _write_header(flat, h, header)
    rows = torch.empty(comm.world_size, flat.numel(), dtype=flat.dtype, device=flat.device)
    work = comm.all_gather(rows.view(-1), flat, async_op=True, label=label, carried=h)
    return [CheckedGathering(work, rows, h, header, carried, comm, check, flat)]
