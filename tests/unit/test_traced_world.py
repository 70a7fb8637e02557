"""The planner's fake world: the communicator knows its collectives carry no data (so the
rank checks stand down without being patched), and with ``backend="gloo"`` a reduce-scatter
holds gloo's copy of its input from the launch to the wait."""
import pytest
import torch

from zerotrain.comm.communicator import Communicator
from zerotrain.comm.trail import CollectiveTrail
from zerotrain.estimate.peak import PeakTracker
from zerotrain.planner import fake_world
from zerotrain.stages.zero3.gather_check import GatherCheck


def test_a_fake_world_turns_the_checks_off_at_the_communicator_not_by_patching():
    agreed, verify = CollectiveTrail.__dict__["agreed"], GatherCheck.verify
    with fake_world(0, 2):
        comm = Communicator()
        assert comm.carries_data is False
        assert comm.all_gather_object({"rank": 0}) == [{"rank": 0}, {"rank": 0}]
        assert CollectiveTrail.__dict__["agreed"] is agreed and GatherCheck.verify is verify
    headers = torch.zeros(2, 4, dtype=torch.int32)   # no rank sent a header
    GatherCheck(enabled=False).verify(headers, [1, 2, 3, 4], rank=0)
    with pytest.raises(Exception, match="different"):
        GatherCheck().verify(headers, [1, 2, 3, 4], rank=0)


@pytest.mark.parametrize("backend, held", [("gloo", 4000), ("nccl", 0)])
def test_gloo_reduce_scatter_holds_a_copy_of_its_input_until_the_wait(backend, held):
    with fake_world(0, 2, backend):
        comm = Communicator()
        inp, out = torch.ones(1000), torch.empty(500)   # 4000 and 2000 bytes
        tracker = PeakTracker()
        with tracker:
            tracker.add_existing([inp, out])
            work = comm.reduce_scatter(out, inp, async_op=True)
            during = tracker.current
            work.wait()
            del work
            after = tracker.current
    assert during == 6000 + held and after == 6000


def test_an_unknown_backend_is_named():
    with pytest.raises(ValueError, match="'mpi'"):
        with fake_world(0, 2, "mpi"):
            pass


def test_a_withdrawn_entry_leaves_the_fingerprint_as_if_never_noted():
    """Note "a forward that raises" in comm/trail.py: below and beyond the kept entries."""
    from zerotrain.comm.trail import MAX_ENTRIES, CollectiveTrail

    for before in (3, MAX_ENTRIES - 1, MAX_ENTRIES, MAX_ENTRIES + 5):
        plain, withdrawn = CollectiveTrail(), CollectiveTrail()
        for trail in (plain, withdrawn):
            for i in range(before):
                trail.note("all_reduce", i, "bucket")
        withdrawn.note("forward", None, "engine forward")
        assert withdrawn.carried() != plain.carried()
        assert not withdrawn.withdraw(withdrawn.count - 1)   # not the last entry
        assert withdrawn.withdraw(withdrawn.count)
        for trail in (plain, withdrawn):
            trail.note("all_reduce", 7, "step")
        assert withdrawn.carried() == plain.carried() and withdrawn.count == plain.count
