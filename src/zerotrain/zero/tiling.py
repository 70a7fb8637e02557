"""``deepspeed.zero.TiledLinear``: one linear layer stored as a grid of smaller ones.

At stage 3 each tile is its own module, so only the tile being computed is gathered at a
time: a layer too large to gather whole still runs. The result equals the untiled layer's:
input columns are split, each output block sums its tiles' products, and the output blocks
are joined. Only the last tile of each output block carries a bias, so it is added once.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from ..errors import TilingError
from ..stages.zero3.zero_init import GatheredParameters


def uniform_parts(num_items: int, num_parts: int) -> List[int]:
    """Boundaries ``[0, ..., num_items]`` of ``num_parts`` near-equal parts, larger first."""
    size, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + size + (1 if part < extra else 0))
    return bounds


class TiledLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` as ``out_splits x in_splits`` tiles.

    ``linears[row][col]`` is the tile of output rows ``out_parts[row]:out_parts[row+1]``
    and input columns ``in_parts[col]:in_parts[col+1]``, built by ``linear_cls`` (extra
    keyword arguments go to it). ``init_linear`` copies a full layer's values into the
    tiles. ``input_is_already_split`` takes the input as ``in_splits`` chunks;
    ``combine_out_splits=False`` returns the output blocks as a list.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 in_splits: int = 1, out_splits: int = 1,
                 input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type = nn.Linear, init_linear: Optional[nn.Module] = None,
                 **kwargs: Any) -> None:
        super().__init__()
        for name, splits, features in (("in_splits", in_splits, in_features),
                                       ("out_splits", out_splits, out_features)):
            if not 1 <= splits <= features:
                raise TilingError(f"TiledLinear: {name}={splits} must be in the range "
                                  f"[1, {features}] (each tile needs at least one feature)")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = uniform_parts(in_features, in_splits)
        self.out_parts = uniform_parts(out_features, out_splits)
        self.linears = nn.ModuleList()
        for row in range(out_splits):
            rows = self.out_parts[row + 1] - self.out_parts[row]
            self.linears.append(nn.ModuleList(
                linear_cls(self.in_parts[col + 1] - self.in_parts[col], rows,
                           bias=bias and col == in_splits - 1, **kwargs)
                for col in range(in_splits)))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.in_splits == 1:
            inputs: Sequence[Any] = [input_]
        elif self.input_is_already_split:
            if len(input_) != self.in_splits:
                raise TilingError(f"TiledLinear: the input comes in {len(input_)} chunks, "
                                  f"in_splits is {self.in_splits}")
            inputs = input_
        else:
            inputs = self._split_global_input(input_, [
                b - a for a, b in zip(self.in_parts, self.in_parts[1:])])
        outputs = []
        for row in range(self.out_splits):
            out = None
            for col in range(self.in_splits):
                out = self._reduce_local_output(col, row, out, self.linears[row][col](inputs[col]))
            outputs.append(out)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input_: torch.Tensor, split_sizes: List[int]) -> List[Any]:
        """The input's last dimension cut at the tiles' column boundaries."""
        if input_.shape[-1] != self.in_features:
            raise TilingError(f"TiledLinear: the input's last dimension is {input_.shape[-1]}, "
                              f"in_features is {self.in_features}")
        return list(torch.split(input_, split_sizes, dim=-1))

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any,
                             new_out: Any) -> Any:
        """Sum of one output block's tile products (a new tensor, never an in-place add)."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: List[Any]) -> Any:
        """The output blocks side by side, as the untiled layer's output."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Write ``other``'s full ``weight`` (and ``bias``) into the tiles.

        At stage 3 every rank must call it (each tile is gathered); rank 0's values are the
        ones kept, as with ``GatheredParameters(modifier_rank=0)``.
        """
        weight = getattr(other, "weight", None)
        if weight is None or tuple(weight.shape) != (self.out_features, self.in_features):
            raise TilingError(f"TiledLinear.copy_params_from: the source's weight has shape "
                              f"{None if weight is None else tuple(weight.shape)}, expected "
                              f"{(self.out_features, self.in_features)}")
        bias = getattr(other, "bias", None)
        if self.use_bias != (bias is not None) or (
                bias is not None and tuple(bias.shape) != (self.out_features,)):
            raise TilingError(f"TiledLinear.copy_params_from: the source's bias is "
                              f"{None if bias is None else tuple(bias.shape)}, this layer "
                              f"{'has' if self.use_bias else 'has no'} bias of "
                              f"{self.out_features}")
        for row in range(self.out_splits):
            r0, r1 = self.out_parts[row], self.out_parts[row + 1]
            for col in range(self.in_splits):
                c0, c1 = self.in_parts[col], self.in_parts[col + 1]
                tile = self.linears[row][col]
                params = [p for p in (tile.weight, tile.bias) if p is not None]
                with GatheredParameters(params, modifier_rank=0):
                    tile.weight.copy_(weight[r0:r1, c0:c1])
                    if tile.bias is not None:
                        tile.bias.copy_(bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """Tiles of a linear class that returns ``(output, bias)`` and leaves the bias for the
    caller to add (Megatron-LM's style): outputs are summed, the one bias is passed on."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any,
                             new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2 and new_out[0] is not None):
            raise TilingError(f"TiledLinearReturnBias: tile [{out_id}][{in_id}] returned "
                              f"{type(new_out).__name__}, expected (output, bias)")
        tensor, bias = new_out
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, bias if bias is not None else old_bias

    def _combine_output_splits(self, outputs: List[Any]) -> Any:
        tensor = super()._combine_output_splits([out for out, _ in outputs])
        biases = [b for _, b in outputs if b is not None]
        return tensor, super()._combine_output_splits(biases) if biases else None
