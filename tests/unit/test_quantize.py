"""Blockwise int8/int4 quantization: sizes, error bound, exact zeros, one scale per block."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from zerotrain.core.quantize import BlockQuantizer


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), block=st.sampled_from([2, 8, 64]),
       rows=st.integers(1, 3), numel=st.integers(1, 300), seed=st.integers(0, 1000))
def test_roundtrip_error_is_at_most_half_a_block_scale(bits, block, rows, numel, seed):
    q = BlockQuantizer(bits, block)
    x = torch.randn(rows, numel, generator=torch.Generator().manual_seed(seed)) * 3
    packed = q.quantize(x)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, q.packed_nbytes(numel))
    back = q.dequantize(packed, numel, torch.float32)
    padded = torch.zeros(rows, q.blocks(numel) * block)
    padded[:, :numel] = x
    scale = padded.view(rows, -1, block).abs().amax(2, keepdim=True) / q.qmax
    bound = (scale / 2).expand(-1, -1, block).reshape(rows, -1)[:, :numel]
    assert ((back - x).abs() <= bound * (1 + 1e-6) + 1e-7).all()


def test_packed_sizes_are_a_quarter_and_an_eighth_plus_scales():
    assert BlockQuantizer(8, 256).packed_nbytes(1024) == 1024 + 4 * 4
    assert BlockQuantizer(4, 256).packed_nbytes(1024) == 512 + 4 * 4
    assert BlockQuantizer(4, 256).packed_nbytes(1) == 128 + 4      # padded to one block


def test_zero_blocks_and_block_maxima_are_exact():
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.5, -3.0, 0.25, 3.0]])
    for bits in (4, 8):
        back = BlockQuantizer(bits, 4).dequantize(BlockQuantizer(bits, 4).quantize(x), 8,
                                                  torch.float32)
        assert (back[0, :4] == 0).all()
        assert back[0, 5] == -3.0 and back[0, 7] == 3.0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        BlockQuantizer(2)
    with pytest.raises(ValueError, match="packed row of 8 values"):
        BlockQuantizer(8, 4).dequantize(torch.zeros(1, 3, dtype=torch.uint8), 8, torch.float32)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), numel=st.integers(1, 600), seed=st.integers(0, 1000),
       exponent=st.integers(-30, 30))
def test_exact_scales_make_a_decode_encode_round_trip_give_the_same_bytes(bits, numel, seed,
                                                                          exponent):
    q = BlockQuantizer(bits, 256, exact_scales=True)
    x = torch.randn(2, numel, generator=torch.Generator().manual_seed(seed)) * 2.0 ** exponent
    packed = q.quantize(x)
    back = q.dequantize(packed, numel, torch.float32)
    assert torch.equal(q.quantize(back), packed)
    padded = torch.zeros(2, q.blocks(numel) * 256)
    padded[:, :numel] = x
    scale = padded.view(2, -1, 256).abs().amax(2, keepdim=True) / q.qmax
    bound = (scale / 2).expand(-1, -1, 256).reshape(2, -1)[:, :numel]
    assert ((back - x).abs() <= bound * (1 + 2.0 ** -15)).all()
    # the same packed size as without them
    assert BlockQuantizer(bits, 256).packed_nbytes(numel) == packed.shape[1]
