"""FlatLayout: where every element of every parameter lives when a group is sharded.

Note: interleaved blocks
    Parameters of one optimizer group are cut into *blocks* (buckets) of consecutive
    parameters. Each parameter of ``numel`` elements is padded to ``chunk * world`` with
    ``chunk = ceil(numel / world)`` and split into ``world`` chunks; rank ``r`` owns chunk
    ``r`` of every parameter. A block is stored as a ``(world, block_chunk)`` matrix whose
    row ``r`` is the concatenation of chunk ``r`` of each of its parameters. So:

    * ``reduce_scatter`` of a block (``world * block_chunk`` elements, row-major) hands rank
      ``r`` exactly row ``r``: its chunks of those parameters, contiguous;
    * ``all_gather`` of the rows rebuilds the block;
    * a rank's *shard* is the concatenation of its rows over all blocks, a flat contiguous
      tensor of ``shard_numel`` elements, which is what the optimizer steps.

    Any world size works, also one that splits parameters unevenly: the padding is at most
    ``world - 1`` elements per parameter and is always zero. The layout depends only on the
    parameter sizes, the bucket size and the world size, so a checkpoint can be resharded
    from this description alone. ``world == 1`` gives the plain concatenation of parameters.

This module is arithmetic plus tensor copies; it never communicates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter sits: its block, its column offset in the block, its chunk."""

    index: int          # position in the group's parameter list
    numel: int          # elements of the full parameter
    chunk: int          # elements each rank owns (padded): ceil(numel / world)
    block: int          # index of the block holding it
    column: int         # offset of its chunk within a block row


@dataclass(frozen=True, slots=True)
class Block:
    """A run of consecutive parameters reduced and gathered by one collective."""

    index: int
    slots: tuple[int, ...]   # parameter indices, in layout order
    chunk: int               # elements per row: sum of the parameters' chunks
    shard_offset: int        # where this block's row starts in a rank's shard


class FlatLayout:
    """Sharding geometry of one parameter group (sizes in elements)."""

    def __init__(self, numels: Sequence[int], *, world: int, bucket_numel: int) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        self.world = world
        self.bucket_numel = bucket_numel
        slots: list[ParamSlot] = []
        blocks: list[Block] = []
        current: list[int] = []
        column = 0
        shard_offset = 0

        def close_block() -> None:
            nonlocal current, column, shard_offset
            if current:
                blocks.append(Block(len(blocks), tuple(current), column, shard_offset))
                shard_offset += column
            current, column = [], 0

        for index, numel in enumerate(numels):
            chunk = math.ceil(numel / world)
            if current and (column + chunk) * world > bucket_numel:
                close_block()
            slots.append(ParamSlot(index, numel, chunk, len(blocks), column))
            current.append(index)
            column += chunk
        close_block()
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.blocks: tuple[Block, ...] = tuple(blocks)
        self.shard_numel: int = shard_offset
        self.numel: int = sum(numels)

    # ------------------------------------------------------------------ sizes
    @property
    def padded_numel(self) -> int:
        """Elements of all ranks' shards together (``world * shard_numel``)."""
        return self.world * self.shard_numel

    def block_full_numel(self, block: Block) -> int:
        return self.world * block.chunk

    def describe(self) -> dict:
        """A JSON-able description, enough to rebuild the layout (for checkpoints)."""
        return {"world": self.world, "bucket_numel": self.bucket_numel,
                "numels": [s.numel for s in self.slots]}

    # ------------------------------------------------------------------ copies
    def block_view(self, block_flat: torch.Tensor, block: Block) -> torch.Tensor:
        """View a block's ``world * chunk`` flat buffer as its ``(world, chunk)`` matrix."""
        return block_flat.view(self.world, block.chunk)

    def add_full_into_block(self, block_matrix: torch.Tensor, slot: ParamSlot,
                            full: torch.Tensor) -> None:
        """``block[:, columns of slot] += full`` laid out as chunks; ``full`` is any shape."""
        if slot.numel == self.world * slot.chunk and slot.chunk and full.is_contiguous():
            # no padding: the parameter is the slot's columns, one chunk a row (a backward
            # hook per gradient runs this; three torch calls instead of six)
            block_matrix[:, slot.column: slot.column + slot.chunk].add_(
                full.view(self.world, slot.chunk))
            return
        for dst, src in self._row_pieces(block_matrix, slot, full.reshape(-1)):
            dst.add_(src)

    def copy_full_into_block(self, block_matrix: torch.Tensor, slot: ParamSlot,
                             full: torch.Tensor) -> None:
        """Like :meth:`add_full_into_block` but overwrites (padding left untouched)."""
        for dst, src in self._row_pieces(block_matrix, slot, full.reshape(-1)):
            dst.copy_(src)

    def copy_block_into_full(self, block_matrix: torch.Tensor, slot: ParamSlot,
                             full: torch.Tensor) -> None:
        """Write the slot's columns of a gathered block back into the full parameter."""
        flat = full.view(-1)
        for src, dst in self._row_pieces(block_matrix, slot, flat):
            dst.copy_(src)

    def shard_of_full(self, full: torch.Tensor, slot: ParamSlot, rank: int) -> torch.Tensor:
        """Rank ``rank``'s chunk of a full parameter, zero-padded to ``slot.chunk``."""
        flat = full.reshape(-1)
        start = min(rank * slot.chunk, slot.numel)
        end = min(start + slot.chunk, slot.numel)
        piece = flat[start:end]
        if piece.numel() == slot.chunk:
            return piece
        out = torch.zeros(slot.chunk, dtype=full.dtype, device=full.device)
        out[: piece.numel()].copy_(piece)
        return out

    def shard_slice(self, slot: ParamSlot) -> slice:
        """Where a parameter's chunk lives inside a rank's flat shard."""
        start = self.blocks[slot.block].shard_offset + slot.column
        return slice(start, start + slot.chunk)

    def _row_pieces(self, block_matrix: torch.Tensor, slot: ParamSlot,
                    flat: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Pairs (block piece, flat piece) covering the parameter's real elements.

        Full rows first as one 2-D piece, then the partial last row (if any).
        """
        cols = block_matrix[:, slot.column: slot.column + slot.chunk]
        if slot.chunk == 0:
            return
        full_rows, rest = divmod(slot.numel, slot.chunk)
        if full_rows:
            yield cols[:full_rows], flat[: full_rows * slot.chunk].view(full_rows, slot.chunk)
        if rest:
            yield cols[full_rows, :rest], flat[full_rows * slot.chunk:]
