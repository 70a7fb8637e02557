"""FlatLayout: the sharding geometry, checked by simulating every rank on one process.

A group's "full buffer" holds all ranks' blocks one after another, each block a row-major
``(world, block.chunk)`` matrix (what the stage-0/1 gradient buffer and a reduce-scatter
input look like). Rank ``r``'s shard must then be row ``r`` of every block, concatenated in
block order, and must equal what :meth:`FlatLayout.shard_of_full` puts at
:meth:`FlatLayout.shard_slice` for every parameter.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:
    import zerotrain.core.flat  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from zerotrain.core.flat import FlatLayout

SENTINEL = -1.0  # never a parameter value below (they are all >= 1)

# Parameter sizes: many 1-element params, sizes not divisible by most worlds.
sizes = st.lists(st.one_of(st.just(1), st.integers(1, 13), st.integers(14, 80)),
                 min_size=1, max_size=8)
worlds = st.integers(1, 5)
buckets = st.one_of(st.integers(1, 12), st.integers(13, 200), st.just(10**9))
seeds = st.integers(0, 2**31 - 1)

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers
def shape_of(numel: int) -> tuple[int, ...]:
    """A 2-D shape where possible, so reshape/view paths are exercised too."""
    if numel % 2 == 0 and numel > 0:
        return (2, numel // 2)
    return (numel,)


def make_params(numels: list[int], seed: int, dtype=torch.float64) -> list[torch.Tensor]:
    """Random parameters whose elements are all distinct and >= 1 (exact in float64)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(numels)
    values = (torch.randperm(total, generator=gen) + 1).to(dtype)
    out, start = [], 0
    for n in numels:
        out.append(values[start: start + n].clone().view(shape_of(n)))
        start += n
    return out


def block_matrix(layout: FlatLayout, full_buffer: torch.Tensor, block) -> torch.Tensor:
    """Block ``block``'s ``(world, chunk)`` matrix inside the all-ranks buffer."""
    start = layout.world * block.shard_offset
    flat = full_buffer[start: start + layout.block_full_numel(block)]
    return layout.block_view(flat, block)


def fill_full_buffer(layout: FlatLayout, params: list[torch.Tensor],
                     fill: float = SENTINEL) -> torch.Tensor:
    """All ranks' blocks, parameters copied in, the rest left at ``fill``."""
    buffer = torch.full((layout.padded_numel,), fill, dtype=params[0].dtype)
    for block in layout.blocks:
        matrix = block_matrix(layout, buffer, block)
        for index in block.slots:
            layout.copy_full_into_block(matrix, layout.slots[index], params[index])
    return buffer


def rank_rows(layout: FlatLayout, buffer: torch.Tensor, rank: int) -> torch.Tensor:
    """Row ``rank`` of every block, concatenated in block order (what reduce-scatter gives)."""
    rows = [block_matrix(layout, buffer, b)[rank] for b in layout.blocks]
    return torch.cat(rows) if rows else buffer.new_zeros(0)


def shard_from_params(layout: FlatLayout, params: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard built parameter by parameter (how a stage builds its master)."""
    shard = torch.full((layout.shard_numel,), SENTINEL, dtype=params[0].dtype)
    for slot, param in zip(layout.slots, params):
        shard[layout.shard_slice(slot)] = layout.shard_of_full(param, slot, rank)
    return shard


# --------------------------------------------------------------------------- (a) ranks
@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets, seed=seeds)
def test_each_ranks_rows_of_all_blocks_equal_its_shard_of_every_parameter(
        numels, world, bucket, seed):
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    params = make_params(numels, seed)
    buffer = fill_full_buffer(layout, params, fill=0.0)
    for rank in range(world):
        rows = rank_rows(layout, buffer, rank)
        assert rows.numel() == layout.shard_numel
        expected = shard_from_params(layout, params, rank)
        assert not (expected == SENTINEL).any(), "shard_slices do not tile the shard"
        assert torch.equal(rows, expected), f"rank {rank} of world {world}"


@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets, seed=seeds)
def test_every_parameter_element_lands_in_exactly_one_block_position(
        numels, world, bucket, seed):
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    params = make_params(numels, seed)
    buffer = fill_full_buffer(layout, params)
    placed = buffer[buffer != SENTINEL]
    expected = torch.cat([p.reshape(-1) for p in params])
    assert placed.numel() == expected.numel()
    assert torch.equal(placed.sort().values, expected.sort().values)


@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets, seed=seeds)
def test_rank_chunks_of_a_parameter_concatenate_to_the_parameter(numels, world, bucket, seed):
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    for slot, param in zip(layout.slots, make_params(numels, seed)):
        chunks = torch.cat([layout.shard_of_full(param, slot, r) for r in range(world)])
        assert chunks.numel() == slot.chunk * world
        assert torch.equal(chunks[: slot.numel], param.reshape(-1))
        assert not chunks[slot.numel:].any()


# --------------------------------------------------------------------------- (b) round trip
@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets, seed=seeds)
def test_copy_block_into_full_round_trips_parameters_exactly(numels, world, bucket, seed):
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    params = make_params(numels, seed)
    buffer = fill_full_buffer(layout, params)
    out = [torch.zeros_like(p) for p in params]
    for block in layout.blocks:
        matrix = block_matrix(layout, buffer, block)
        for index in block.slots:
            layout.copy_block_into_full(matrix, layout.slots[index], out[index])
    for original, rebuilt in zip(params, out):
        assert rebuilt.shape == original.shape
        assert torch.equal(rebuilt, original)


@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets, seed=seeds)
def test_all_gathered_rank_shards_rebuild_the_parameters(numels, world, bucket, seed):
    """The publish path: stack every rank's shard rows per block, copy out, get the params."""
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    params = make_params(numels, seed)
    shards = [shard_from_params(layout, params, r) for r in range(world)]
    gathered = torch.stack(shards)  # (world, shard_numel): an all-gather of the shards
    out = [torch.zeros_like(p) for p in params]
    for block in layout.blocks:
        matrix = gathered[:, block.shard_offset: block.shard_offset + block.chunk]
        for index in block.slots:
            layout.copy_block_into_full(matrix, layout.slots[index], out[index])
    for original, rebuilt in zip(params, out):
        assert torch.equal(rebuilt, original)


# --------------------------------------------------------------------------- (c) padding
@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets, seed=seeds)
def test_padding_is_less_than_world_per_parameter_and_zero_in_shards(
        numels, world, bucket, seed):
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    params = make_params(numels, seed)
    for slot in layout.slots:
        assert slot.chunk == math.ceil(slot.numel / world)
        assert 0 <= slot.chunk * world - slot.numel < world
    # copy_full_into_block leaves exactly the padding untouched ...
    buffer = fill_full_buffer(layout, params)
    assert int((buffer == SENTINEL).sum()) == layout.padded_numel - layout.numel
    # ... and the shards a stage builds hold zeros there.
    zero_padded = torch.where(buffer == SENTINEL, torch.zeros_like(buffer), buffer)
    for rank in range(world):
        assert torch.equal(shard_from_params(layout, params, rank),
                           rank_rows(layout, zero_padded, rank))


# --------------------------------------------------------------------------- (d) sizes
@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets)
def test_sizes_add_up_and_blocks_tile_the_shard_in_order(numels, world, bucket):
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    assert layout.shard_numel * world == layout.padded_numel
    assert layout.numel == sum(numels)
    assert layout.shard_numel == sum(s.chunk for s in layout.slots)
    assert [s.numel for s in layout.slots] == list(numels)
    assert [s.index for s in layout.slots] == list(range(len(numels)))
    # Blocks: consecutive parameters in order, contiguous in the shard.
    assert [i for b in layout.blocks for i in b.slots] == list(range(len(numels)))
    offset = 0
    for k, block in enumerate(layout.blocks):
        assert block.index == k
        assert block.shard_offset == offset
        column = 0
        for index in block.slots:
            slot = layout.slots[index]
            assert slot.block == k and slot.column == column
            column += slot.chunk
        assert block.chunk == column
        assert layout.block_full_numel(block) == world * block.chunk
        offset += block.chunk
    assert offset == layout.shard_numel


@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets)
def test_blocks_respect_the_bucket_size_except_a_single_oversized_parameter(
        numels, world, bucket):
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    for block in layout.blocks:
        if layout.block_full_numel(block) > bucket:
            assert len(block.slots) == 1, (block, bucket)
            assert layout.slots[block.slots[0]].chunk * world > bucket


@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets)
def test_a_block_closes_only_when_the_next_parameter_would_overflow_the_bucket(
        numels, world, bucket):
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    for block, following in zip(layout.blocks, layout.blocks[1:]):
        first_next = layout.slots[following.slots[0]]
        assert (block.chunk + first_next.chunk) * world > bucket


def test_parameters_that_fill_the_bucket_exactly_share_one_block():
    layout = FlatLayout([3, 1, 2, 4], world=2, bucket_numel=8)  # chunks 2+1+1 fill 2 x 4
    assert [b.slots for b in layout.blocks] == [(0, 1, 2), (3,)]
    assert [layout.block_full_numel(b) for b in layout.blocks] == [8, 4]
    exact = FlatLayout([4, 4], world=2, bucket_numel=8)
    assert [b.slots for b in exact.blocks] == [(0, 1)]


def test_huge_bucket_gives_a_single_block():
    layout = FlatLayout([3, 1, 7, 2], world=3, bucket_numel=10**9)
    assert len(layout.blocks) == 1
    assert layout.blocks[0].slots == (0, 1, 2, 3)


def test_bucket_of_one_element_gives_a_block_per_parameter():
    layout = FlatLayout([3, 1, 7, 2], world=2, bucket_numel=1)
    assert [b.slots for b in layout.blocks] == [(0,), (1,), (2,), (3,)]


@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets)
def test_describe_rebuilds_the_same_layout(numels, world, bucket):
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    rebuilt = FlatLayout(layout.describe()["numels"], world=layout.describe()["world"],
                         bucket_numel=layout.describe()["bucket_numel"])
    assert rebuilt.slots == layout.slots
    assert rebuilt.blocks == layout.blocks


# --------------------------------------------------------------------------- (e) add
@SETTINGS
@given(numels=sizes, world=worlds, bucket=buckets, seed=seeds)
def test_add_full_into_block_adds_to_real_elements_and_leaves_padding(
        numels, world, bucket, seed):
    layout = FlatLayout(numels, world=world, bucket_numel=bucket)
    params = make_params(numels, seed)
    placed = fill_full_buffer(layout, params, fill=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    start = torch.randint(-50, 50, (layout.padded_numel,), generator=gen).to(torch.float64)
    buffer = start.clone()
    for _ in range(2):
        for block in layout.blocks:
            matrix = block_matrix(layout, buffer, block)
            for index in block.slots:
                layout.add_full_into_block(matrix, layout.slots[index], params[index])
    assert torch.equal(buffer, start + 2 * placed)


def test_add_full_into_block_accepts_a_non_contiguous_gradient():
    layout = FlatLayout([6], world=4, bucket_numel=100)
    grad = torch.arange(1.0, 7.0).view(2, 3).t()  # non-contiguous (3, 2)
    matrix = torch.zeros(4, layout.blocks[0].chunk)
    layout.add_full_into_block(matrix, layout.slots[0], grad)
    assert torch.equal(matrix.reshape(-1)[:6], grad.reshape(-1))


# --------------------------------------------------------------------------- world 1
@SETTINGS
@given(numels=sizes, bucket=buckets, seed=seeds)
def test_world_one_layout_is_the_plain_concatenation(numels, bucket, seed):
    layout = FlatLayout(numels, world=1, bucket_numel=bucket)
    params = make_params(numels, seed)
    assert layout.shard_numel == layout.padded_numel == sum(numels)
    offset = 0
    for slot, n in zip(layout.slots, numels):
        assert slot.chunk == n
        assert layout.shard_slice(slot) == slice(offset, offset + n)
        offset += n
    buffer = fill_full_buffer(layout, params)
    assert torch.equal(buffer, torch.cat([p.reshape(-1) for p in params]))
    assert torch.equal(shard_from_params(layout, params, 0), buffer)


def test_uneven_split_example_by_hand():
    """5 elements over 2 ranks: chunk 3, rank 1 holds [3, 4, pad]."""
    layout = FlatLayout([5, 1], world=2, bucket_numel=100)
    a = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    b = torch.tensor([9.0])
    buffer = fill_full_buffer(layout, [a, b], fill=0.0)
    assert buffer.view(2, 4).tolist() == [[1, 2, 3, 9], [4, 5, 0, 0]]
    assert layout.shard_of_full(a, layout.slots[0], 1).tolist() == [4, 5, 0]
    assert layout.shard_of_full(b, layout.slots[1], 1).tolist() == [0]


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("world", [0, -1])
def test_world_below_one_raises_value_error(world):
    with pytest.raises(ValueError, match="world"):
        FlatLayout([4], world=world, bucket_numel=8)


@pytest.mark.parametrize("bucket", [0, -5])
def test_bucket_below_one_raises_value_error(bucket):
    with pytest.raises(ValueError, match="bucket"):
        FlatLayout([4], world=2, bucket_numel=bucket)
