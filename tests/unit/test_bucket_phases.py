"""GradientBuckets' phases (Note "bucket phases" in buckets.py) on one process, with a
communicator that records reductions instead of running them."""
from __future__ import annotations

import pytest
import torch

from zerotrain.stages.buckets import AllReduceGrads, BucketPhase
from zerotrain.errors import StateError
from zerotrain.core.flat import FlatLayout


class RecordingComm:
    """Stands in for Communicator: a synchronous all-reduce that only records its label."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    def reduce_scatter(self, *args, **kwargs):
        raise AssertionError("stage 0 does not reduce-scatter")

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool, label: str):
        self.labels.append(label)
        return None


def _stage0(overlap: bool) -> tuple[AllReduceGrads, RecordingComm]:
    comm = RecordingComm()
    layout = FlatLayout([4, 6], world=1, bucket_numel=5)
    buckets = AllReduceGrads([layout], comm, accum_dtype=torch.float32,
                             device=torch.device("cpu"), overlap=overlap)
    return buckets, comm


def _backward(buckets: AllReduceGrads, boundary: bool) -> None:
    buckets.begin(boundary)
    buckets.add(0, 1, torch.ones(6))
    buckets.add(0, 0, torch.ones(4))


def test_stage0_without_overlap_accumulates_then_defers_the_boundary_until_collect():
    buckets, comm = _stage0(overlap=False)
    assert buckets.phase is BucketPhase.IDLE
    buckets.begin(False)
    assert buckets.phase is BucketPhase.ACCUMULATING and buckets.active
    buckets.add(0, 0, torch.ones(4))
    buckets.finish()
    assert buckets.phase is BucketPhase.IDLE and not comm.labels
    _backward(buckets, boundary=True)
    assert buckets.phase is BucketPhase.REDUCING
    buckets.finish()
    assert buckets.phase is BucketPhase.DEFERRED and not buckets.active and not comm.labels
    with pytest.raises(StateError, match="before the optimizer step consumed"):
        buckets.begin(False)
    assert buckets.phase is BucketPhase.DEFERRED
    buckets.collect()
    assert buckets.phase is BucketPhase.IDLE
    assert len(comm.labels) == len(buckets.layouts[0].blocks) == 2


def test_with_overlap_the_boundary_is_reduced_by_the_end_of_backward():
    buckets, comm = _stage0(overlap=True)
    _backward(buckets, boundary=True)
    buckets.finish()
    assert buckets.phase is BucketPhase.IDLE and len(comm.labels) == 2
    buckets.collect()   # nothing left to do
    assert buckets.phase is BucketPhase.IDLE and len(comm.labels) == 2


@pytest.mark.parametrize("start, to, expected", [
    (BucketPhase.IDLE, BucketPhase.DEFERRED, "gradient buckets are idle, expected reducing "
                                             "to become deferred"),
    (BucketPhase.ACCUMULATING, BucketPhase.REDUCING, "gradient buckets are accumulating, "
                                                     "expected idle to become reducing"),
    (BucketPhase.DEFERRED, BucketPhase.ACCUMULATING, "gradient buckets are deferred, "
                                                     "expected idle to become accumulating"),
])
def test_an_illegal_transition_names_the_phase_and_the_one_expected(start, to, expected):
    buckets, _ = _stage0(overlap=False)
    buckets.phase = start
    with pytest.raises(StateError, match=expected):
        buckets._move(to)
    assert buckets.phase is start


def test_on_reduced_hears_each_group_once_at_the_boundary_with_its_shard():
    """The receiver given at construction hears, only in the boundary micro-step, each group
    once, as its last block's reduction completes (groups in launch order: the last group's
    blocks go first), with the group's reduced shard."""
    from zerotrain.stages.buckets import ReduceScatterEveryMicroStep

    def reduce_scatter(out, full, *, async_op, label):   # one rank: the shard is the whole
        out.copy_(full)
        return None

    heard: list[tuple[int, torch.Tensor]] = []
    layouts = [FlatLayout([4, 6], world=1, bucket_numel=5), FlatLayout([3], world=1,
                                                                       bucket_numel=5)]
    buckets = ReduceScatterEveryMicroStep(
        layouts, RecordingComm(), accum_dtype=torch.float32, device=torch.device("cpu"),
        overlap=False, reduce_scatter=reduce_scatter,
        on_reduced=lambda g, shard: heard.append((g, shard)))
    for boundary in (False, True):
        buckets.begin(boundary)
        buckets.add(1, 0, torch.ones(3))
        buckets.add(0, 1, torch.ones(6))
        buckets.add(0, 0, torch.ones(4))
        buckets.finish()
        assert [g for g, _ in heard] == ([1, 0] if boundary else [])
    assert all(shard is buckets.reduced_shard(g) for g, shard in heard)
    assert torch.equal(heard[1][1], torch.full((10,), 2.0))   # both micro-steps summed
