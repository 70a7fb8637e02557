"""zero.Init's arguments are honoured or refused, and its broadcast runs on the
communicator's device (NCCL takes only CUDA tensors, whatever device a module is built on)."""
import pytest
import torch
from torch import nn

from zerotrain.stages.zero3.zero_init import Init
from zerotrain.stages.zero3.writes import PartitionedWrites


class _Sent(Exception):
    pass


class _FarComm:
    """A group that communicates on another device than the one modules are built on."""

    rank, world_size, group, device = 0, 2, None, torch.device("meta")

    def __init__(self) -> None:
        self.devices = []

    def broadcast(self, tensor, *, src, label=""):
        self.devices.append(tensor.device)
        raise _Sent


def test_zero_init_broadcasts_on_the_communicators_device():
    init = Init(enabled=False)
    init.comm = _FarComm()
    init._writes = PartitionedWrites(init._run_on_full)
    with pytest.raises(_Sent):
        init._partition_module(nn.Linear(3, 4))
    assert init.comm.devices == [torch.device("meta")]


@pytest.mark.parametrize("kwargs,match", [
    ({"remote_device": "nvme"}, "remote_device='nvme'"),
    ({"remote_device": "cuda:3"}, "remote_device='cuda:3'"),
    ({"pin_memory": True}, "needs remote_device='cpu'"),
])
def test_unsupported_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Init(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_pin_memory_without_cuda_is_refused():
    with pytest.raises(ValueError, match="needs CUDA"):
        Init(remote_device="cpu", pin_memory=True)


class _OneRank:
    rank, world_size, group, device = 0, 1, None, torch.device("cpu")

    def __init__(self, group=None) -> None:
        self.group = group


def test_one_rank_group_under_a_multi_process_launcher_is_refused(monkeypatch):
    """A one-rank group made before zero.Init while the launcher started several processes
    would leave every rank with whole parameters: refused, naming the launcher's world."""
    from zerotrain.errors import StateError
    from zerotrain.stages.zero3 import zero_init
    from zerotrain.zero.partition_parameters import _contradicting_single_rank_pg_error

    monkeypatch.setattr(zero_init, "init_distributed", lambda verbose=False: None)
    monkeypatch.setattr(zero_init, "Communicator", _OneRank)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(StateError, match="WORLD_SIZE=4 processes.*init_distributed"):
        with Init():
            pass
    with Init(data_parallel_group=object()):   # a one-rank group passed on purpose
        nn.Linear(2, 2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with Init():
        nn.Linear(2, 2)
    for world, env in ((2, {"WORLD_SIZE": "8"}), (1, {}), (1, {"WORLD_SIZE": "x"}),
                       (1, {"WORLD_SIZE": None}), (1, {"WORLD_SIZE": ""})):
        assert _contradicting_single_rank_pg_error(world, None, env=env) is None
