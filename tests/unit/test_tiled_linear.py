"""``zero.TiledLinear`` (DeepSpeed's ``runtime.zero.tiling``): the tiles hold the full
layer's blocks, and forward and backward equal the untiled layer's."""
import copy

import pytest
import torch

from zerotrain.errors import TilingError
from zerotrain.zero import TiledLinear, TiledLinearReturnBias


@pytest.mark.parametrize("in_f,out_f,in_splits,out_splits,bias",
                         [(29, 23, 3, 2, True), (23, 29, 1, 5, False), (8, 8, 8, 8, True)])
def test_tiles_hold_the_blocks_and_match_the_full_layer(in_f, out_f, in_splits, out_splits,
                                                        bias):
    torch.manual_seed(0)
    base = torch.nn.Linear(in_f, out_f, bias=bias)
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        init_linear=copy.deepcopy(base))
    assert tiled.in_parts[0] == 0 and tiled.in_parts[-1] == in_f
    assert tiled.out_parts[-1] == out_f and len(tiled.out_parts) == out_splits + 1
    for row in range(out_splits):
        r0, r1 = tiled.out_parts[row], tiled.out_parts[row + 1]
        for col in range(in_splits):
            c0, c1 = tiled.in_parts[col], tiled.in_parts[col + 1]
            tile = tiled.linears[row][col]
            assert torch.equal(tile.weight, base.weight[r0:r1, c0:c1])
            # one bias per output block, on its last tile
            assert (tile.bias is not None) == (bias and col == in_splits - 1)
    x = torch.randn(3, in_f)
    torch.testing.assert_close(tiled(x), base(x))
    base(x).square().sum().backward()
    tiled(x).square().sum().backward()
    for row in range(out_splits):
        r0, r1 = tiled.out_parts[row], tiled.out_parts[row + 1]
        for col in range(in_splits):
            c0, c1 = tiled.in_parts[col], tiled.in_parts[col + 1]
            tile = tiled.linears[row][col]
            torch.testing.assert_close(tile.weight.grad, base.weight.grad[r0:r1, c0:c1])
            if tile.bias is not None:
                torch.testing.assert_close(tile.bias.grad, base.bias.grad[r0:r1])


def test_split_input_and_uncombined_output():
    base = torch.nn.Linear(10, 6)
    tiled = TiledLinear(10, 6, in_splits=2, out_splits=3, init_linear=base,
                        input_is_already_split=True, combine_out_splits=False)
    x = torch.randn(4, 10)
    blocks = tiled(list(torch.split(x, [5, 5], dim=-1)))
    assert len(blocks) == 3
    torch.testing.assert_close(torch.cat(blocks, dim=-1), base(x))
    with pytest.raises(TilingError, match="3 chunks"):
        tiled([x, x, x])


class _ReturnsBias(torch.nn.Linear):
    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), self.bias


def test_return_bias_passes_the_bias_on_unadded():
    base = _ReturnsBias(9, 7)
    tiled = TiledLinearReturnBias(9, 7, in_splits=2, out_splits=2, linear_cls=_ReturnsBias,
                                  init_linear=base)
    x = torch.randn(2, 9)
    out, bias = tiled(x)
    torch.testing.assert_close(out, base(x)[0])
    torch.testing.assert_close(bias, base.bias)


@pytest.mark.parametrize("splits", [0, 33])
def test_bad_split_counts_are_refused_by_name(splits):
    with pytest.raises(TilingError, match="in_splits"):
        TiledLinear(32, 32, in_splits=splits)
    with pytest.raises(RuntimeError, match="out_splits"):  # DeepSpeed raises RuntimeError
        TiledLinear(32, 32, out_splits=splits)


def test_source_of_the_wrong_shape_is_refused():
    with pytest.raises(TilingError, match=r"\(4, 5\)"):
        TiledLinear(4, 4, init_linear=torch.nn.Linear(5, 4))
    with pytest.raises(TilingError, match="bias"):
        TiledLinear(4, 4, bias=False, init_linear=torch.nn.Linear(4, 4))
