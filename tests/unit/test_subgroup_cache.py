"""The subgroup cache is keyed by the default group's id(), which a new default group may
reuse after the first is destroyed: an entry made from another default group is a miss,
never a dead group handed out."""
import socket

import torch
import torch.distributed as dist

from zerotrain.comm import communicator as C


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_entry_from_another_default_group_is_not_reused():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    saved = dict(C._SUBGROUPS)
    try:
        comm = C.Communicator(dist.group.WORLD)
        key = (id(dist.group.WORLD), ((0,),))
        stale = object()   # what a destroyed world's subgroup would be
        C._SUBGROUPS[key] = (object(), stale)   # made from another world with this id()
        sub = comm.subgroup([[0]])
        assert sub.group is not stale
        assert C._SUBGROUPS[key][0] is dist.group.WORLD
        assert comm.subgroup([[0]]).group is sub.group   # a hit from this world is reused
        t = torch.ones(2)
        dist.all_reduce(t, group=sub.group)
        assert t.tolist() == [1.0, 1.0]
    finally:
        C._SUBGROUPS.clear()
        C._SUBGROUPS.update(saved)
        dist.destroy_process_group()
