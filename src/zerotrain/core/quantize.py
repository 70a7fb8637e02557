"""Blockwise symmetric quantization to int8 or int4, in plain PyTorch ops (ZeRO++'s qwZ, qgZ).

Note: wire format
    A row of ``n`` values is padded with zeros to a whole number of ``block``-element blocks.
    Each block gets one fp32 scale, ``absmax / qmax`` (qmax 127 for int8, 7 for int4; an
    all-zero block gets scale 1), and its values become ``round(x / scale)``, clamped to
    ``[-qmax, qmax]``. The packed row is one uint8 tensor: the payload (one byte per value
    at 8 bits; two values per byte at 4 bits, low nibble first, each stored as ``q + 8``)
    followed by the scales' bytes. Payload and scales travel in one collective, and a row's
    size depends only on ``n``, so every rank knows every other rank's packed size.
    Dequantizing gives ``q * scale``; the error of an element is at most half its block's
    scale. Values are always rounded to nearest, so every rank decodes the same numbers.

Note: exact scales
    With ``exact_scales`` a block's scale is rounded up to 17 significant bits. Then ``q *
    scale`` is exact in fp32 for every ``|q| <= 127``, the block's largest value decodes to
    exactly ``127 * scale``, and quantizing the decoded values again gives the same scale and
    the same integers: a round trip through full precision (a checkpoint, a write that
    changes nothing) leaves the bytes as they were. The scale grows by at most 2**-16 of
    itself, so the error bound is unchanged in practice.

The optimizer never sees quantized values: it steps exact fp32 masters. Only what crosses the
wire (parameters gathered for use, gradients on their way to the owner) is quantized.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4


@dataclass(frozen=True)
class BlockQuantizer:
    """Quantize rows of values in blocks of ``block`` elements to ``bits`` (8 or 4)."""

    bits: int
    block: int = 256
    exact_scales: bool = False   # Note: exact scales

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.block < 2 or self.block % 2:
            raise ValueError(f"block must be an even number >= 2, got {self.block}")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def packed_nbytes(self, numel: int) -> int:
        """Bytes of one packed row of ``numel`` values (payload + scales)."""
        padded = self.blocks(numel) * self.block
        return padded * self.bits // 8 + self.blocks(numel) * SCALE_BYTES

    def quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """``(r, n)`` (or ``(n,)``) floating values -> ``(r, packed_nbytes(n))`` uint8."""
        rows = rows.reshape(1, -1) if rows.dim() == 1 else rows
        r, n = rows.shape
        nb = self.blocks(n)
        x = torch.zeros(r, nb * self.block, dtype=torch.float32, device=rows.device)
        x[:, :n] = rows
        x = x.view(r, nb, self.block)
        scale = x.abs().amax(dim=2) / self.qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        if self.exact_scales:
            mantissa, exponent = torch.frexp(scale)
            scale = torch.ldexp(torch.ceil(mantissa * 2.0 ** 17) / 2.0 ** 17, exponent)
        q = torch.round(x / scale.unsqueeze(2)).clamp_(-self.qmax, self.qmax)
        if self.bits == 8:
            payload = q.to(torch.int8).view(torch.uint8).view(r, -1)
        else:
            nibbles = (q + 8).to(torch.uint8).view(r, -1, 2)
            payload = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
        return torch.cat([payload, scale.contiguous().view(torch.uint8).view(r, -1)], dim=1)

    def dequantize(self, packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``(r, packed_nbytes(numel))`` uint8 -> ``(r, numel)`` values of ``dtype``."""
        packed = packed.reshape(1, -1) if packed.dim() == 1 else packed
        r = packed.shape[0]
        nb = self.blocks(numel)
        split = nb * self.block * self.bits // 8
        if packed.shape[1] != split + nb * SCALE_BYTES:
            raise ValueError(f"a packed row of {numel} values has "
                             f"{split + nb * SCALE_BYTES} bytes, got {packed.shape[1]}")
        scale = _fresh(packed[:, split:]).view(torch.float32).view(r, nb, 1)
        payload = packed[:, :split]
        if self.bits == 8:
            q = _fresh(payload).view(torch.int8).to(torch.float32)
        else:
            low = (payload & 0x0F).to(torch.float32) - 8
            high = (payload >> 4).to(torch.float32) - 8
            q = torch.stack([low, high], dim=2).view(r, -1)
        values = q.view(r, nb, self.block) * scale
        return values.view(r, -1)[:, :numel].to(dtype)


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A dense copy starting at offset 0, so its bytes can be viewed as another dtype."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
