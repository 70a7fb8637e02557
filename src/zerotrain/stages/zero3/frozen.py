"""Frozen parameters kept as int8 blocks (``zero_quantized_nontrainable_weights``).

Note: quantized frozen shards
    Parameters no optimizer steps (a LoRA base, frozen embeddings) never change, so stage 3
    keeps this rank's chunk of each as int8 blocks of 256 with one fp32 scale per block
    (``quantize.py``) instead of the parameter dtype: 1 byte per element plus 4 per block,
    where bf16 costs 2 and fp32 4 (plus 4 for a separate fp32 master in 16-bit training).
    The last block's padding is not stored, so a chunk of 48 elements costs 52 bytes, not
    260. The full-precision chunk is quantized once (at ``initialize``, from the parameter or
    from ``zero.Init``'s chunk) and not kept, and no fp32 master exists for it. Each
    parameter's chunk is quantized on its own, blocks starting at its first element, so
    writing one parameter never moves another's values and every rank can compute what any
    rank keeps (``round_trip``).

    A gather all-gathers these bytes as they are (one collective per unit beside the
    trainable parameters' gather): they are int8 blocks already, as qwZ would send, so
    sending them costs no further rounding and half the bytes of bf16; every rank decodes every rank's
    rows, so all ranks use the same values, ``dequantize(quantize(chunk))`` cast to the
    parameter dtype. Scales are exact (Note "exact scales" in ``quantize.py``): a checkpoint
    saves the decoded values in fp32, and loading them quantizes back to the same bytes.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...offload import Storage
from ...core.quantize import SCALE_BYTES, BlockQuantizer
from . import partition as P

FROZEN_QUANTIZER = BlockQuantizer(bits=8, block=256, exact_scales=True)


class QuantizedSlice:
    """This rank's chunks of a unit's frozen parameters, as packed int8 rows.

    ``slice`` is the unit's ``GroupSlice`` of group None: its layout gives each parameter's
    chunk size and where that chunk sits in the flat fp32 record a checkpoint saves.
    ``packed`` holds one packed row (payload, then scales) per parameter, back to back.
    """

    def __init__(self, slice, *, storage: Storage, dtype: torch.dtype,
                 quantizer: BlockQuantizer = FROZEN_QUANTIZER) -> None:
        self.slice = slice
        self.dtype = dtype            # what gathered values are cast to
        self.quantizer = quantizer
        self.offsets: list[int] = []
        self.nbytes: list[int] = []
        total = 0
        for slot in slice.layout.slots:
            self.offsets.append(total)
            self.nbytes.append(slot.chunk + SCALE_BYTES * quantizer.blocks(slot.chunk))
            total += self.nbytes[-1]
        self.packed = storage.zeros(total, torch.uint8)

    @property
    def indices(self) -> list[int]:
        """Positions of these parameters in the unit's parameter list."""
        return self.slice.indices

    def row(self, k: int) -> torch.Tensor:
        """The stored bytes of the ``k``-th parameter's chunk (a view of ``packed``)."""
        return self.packed[self.offsets[k]: self.offsets[k] + self.nbytes[k]]

    def store(self, k: int, chunk: torch.Tensor) -> None:
        """Quantize this rank's chunk of the slice's ``k``-th parameter into place."""
        if self.nbytes[k]:
            packed = self.quantizer.quantize(chunk.detach().reshape(1, -1).float())
            self.row(k).copy_(_unpad(packed, chunk.numel(), self.quantizer).view(-1))

    def values(self, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This rank's chunk of the ``k``-th parameter, decoded (a new tensor)."""
        chunk = self.slice.layout.slots[k].chunk
        if not chunk:
            return torch.zeros(0, dtype=dtype, device=self.packed.device)
        return self._decode(self.row(k).reshape(1, -1), chunk, dtype).view(-1)

    def round_trip(self, k: int, full: torch.Tensor, world: int) -> torch.Tensor:
        """``full`` as the ranks would decode it after each quantizes its chunk of it: the
        value the parameter takes when ``full`` is written into it (same shape and dtype)."""
        chunk = self.slice.layout.slots[k].chunk
        flat = full.detach().reshape(-1)
        rows = torch.stack([P.chunk_of(flat, r, world) for r in range(world)]).float()
        decoded = self.quantizer.dequantize(self.quantizer.quantize(rows), chunk, full.dtype)
        # the same numbers as store() then _decode(): the padding dropped is zeros
        return decoded.reshape(-1)[: flat.numel()].view(full.shape)

    def decode_into(self, rows: torch.Tensor, segments: Sequence[torch.Tensor],
                    world: int) -> None:
        """Write every parameter's full value from ``rows`` (every rank's ``packed``,
        ``(world, packed.numel())``) into its segment of the unit's ``full`` buffer, rank
        order, as a plain gather lands there (Note "gathering in place" in ``wire.py``)."""
        with torch.no_grad():
            for k, (slot, i) in enumerate(zip(self.slice.layout.slots, self.indices)):
                if not slot.chunk:
                    continue
                part = rows[:, self.offsets[k]: self.offsets[k] + self.nbytes[k]]
                decoded = self._decode(part, slot.chunk, self.dtype)
                segments[i][: world * slot.chunk].view(world, slot.chunk).copy_(decoded)

    def _decode(self, rows: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows ``(r, nbytes)`` of ``numel`` values -> ``(r, numel)`` of ``dtype``."""
        q = self.quantizer
        padded = torch.zeros(rows.shape[0], q.packed_nbytes(numel), dtype=torch.uint8,
                             device=rows.device)
        padded[:, :numel] = rows[:, :numel]
        padded[:, q.blocks(numel) * q.block:] = rows[:, numel:]
        return q.dequantize(padded, numel, dtype)

    def record_values(self) -> torch.Tensor:
        """The slice as a flat fp32 shard laid out like a master (``layout.shard_slice``),
        decoded: what a checkpoint saves for these parameters (a new tensor)."""
        layout = self.slice.layout
        out = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.packed.device)
        for k, slot in enumerate(layout.slots):
            out[layout.shard_slice(slot)] = self.values(k)
        return out

    def load_record(self, values: torch.Tensor) -> None:
        """Quantize a flat fp32 shard laid out like ``record_values`` into place."""
        layout = self.slice.layout
        for k, slot in enumerate(layout.slots):
            self.store(k, values[layout.shard_slice(slot)])


def _unpad(packed: torch.Tensor, numel: int, quantizer: BlockQuantizer) -> torch.Tensor:
    """A packed row without its last block's padding: ``numel`` payload bytes, then the
    scales (8-bit payloads only)."""
    split = quantizer.blocks(numel) * quantizer.block
    return torch.cat([packed[:, :numel], packed[:, split:]], dim=1)
