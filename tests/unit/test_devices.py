"""Device selection and the collective device check, decided without a GPU: the CUDA and
torch.distributed queries are replaced by fakes, so the decisions a CUDA machine would take
are checked on CPU (tests/gpu/test_cuda.py repeats them on a GPU when there is one)."""
import importlib

import pytest
import torch
import torch.distributed as dist

from zerotrain import comm as C
I = importlib.import_module("zerotrain.engine.build")


class FakeCuda:
    """What torch.cuda answers on a node with ``count`` GPUs; records set_device."""

    def __init__(self, monkeypatch, count: int, current: int = 0) -> None:
        self.count, self.current, self.set_calls = count, current, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set)

    def _set(self, device) -> None:
        index = torch.device(device).index if not isinstance(device, int) else device
        self.set_calls.append(index)
        self.current = index


@pytest.mark.parametrize("backend,expected", [
    ("nccl", {"cuda": "nccl"}),
    ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
    ("CPU:gloo, cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
])
def test_backend_strings_map_devices_to_backends(backend, expected):
    assert C._backend_map(backend) == expected


def test_no_backend_serves_cuda_with_nccl_when_cuda_exists(monkeypatch):
    FakeCuda(monkeypatch, count=2)
    assert C._backend_map("undefined") == {"cpu": "gloo", "cuda": "nccl"}
    FakeCuda(monkeypatch, count=0)
    assert C._backend_map("undefined") == {"cpu": "gloo"}


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "undefined"])
def test_device_is_the_local_rank_gpu_whatever_the_backend_string(monkeypatch, backend):
    FakeCuda(monkeypatch, count=4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert C.select_device(C._backend_map(backend)) == torch.device("cuda", 3)


def test_device_without_local_rank_is_the_current_gpu(monkeypatch):
    FakeCuda(monkeypatch, count=4, current=2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert C.select_device({"cuda": "nccl"}) == torch.device("cuda", 2)


def test_device_is_cpu_without_cuda_or_with_gloo_only(monkeypatch):
    FakeCuda(monkeypatch, count=0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert C.select_device({"cpu": "gloo", "cuda": "nccl"}) == torch.device("cpu")
    FakeCuda(monkeypatch, count=2)
    assert C.select_device({"cpu": "gloo", "cuda": "gloo"}) == torch.device("cpu")


def test_local_rank_beyond_the_gpus_is_a_clear_error(monkeypatch):
    FakeCuda(monkeypatch, count=2)
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=5 but this node has 2 CUDA"):
        C.select_device({"cuda": "nccl"})


def _capture_init(monkeypatch, fake: FakeCuda) -> dict:
    seen: dict = {}

    def init_process_group(backend, **kwargs):
        seen.update(kwargs, backend=backend, current_at_init=fake.current)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    for key in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    return seen


@pytest.mark.parametrize("backend", [None, "nccl", "cpu:gloo,cuda:nccl"])
def test_init_distributed_sets_the_device_before_the_group_and_passes_device_id(
        monkeypatch, backend):
    fake = FakeCuda(monkeypatch, count=8)
    monkeypatch.setenv("LOCAL_RANK", "5")
    seen = _capture_init(monkeypatch, fake)
    C.init_distributed(dist_backend=backend, verbose=False)
    assert seen["backend"] == (backend or "nccl")
    assert seen["current_at_init"] == 5, "set_device must run before init_process_group"
    assert seen["device_id"] == torch.device("cuda", 5)


def test_init_distributed_on_cpu_passes_no_device(monkeypatch):
    fake = FakeCuda(monkeypatch, count=0)
    seen = _capture_init(monkeypatch, fake)
    C.init_distributed(verbose=False)
    assert seen["backend"] == "gloo" and "device_id" not in seen and fake.set_calls == []


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "undefined"])
def test_initialize_moves_a_user_group_off_cuda0(monkeypatch, backend):
    """A group created by the user without set_device: every rank would stay on cuda:0."""
    fake = FakeCuda(monkeypatch, count=8, current=0)
    monkeypatch.setenv("LOCAL_RANK", "6")
    monkeypatch.setattr(I, "group_backends", lambda *a: C._backend_map(backend))
    assert I._device() == torch.device("cuda", 6)
    assert fake.current == 6


def test_initialize_keeps_a_gloo_user_group_on_cpu(monkeypatch):
    fake = FakeCuda(monkeypatch, count=8)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(I, "group_backends", lambda *a: C._backend_map("gloo"))
    assert I._device() == torch.device("cpu") and fake.set_calls == []


# --------------------------------------------------------------------------- the guard
def _communicator(backends: dict) -> C.Communicator:
    comm = C.Communicator.__new__(C.Communicator)
    comm.rank, comm.backends = 1, backends
    return comm


def test_collective_on_the_wrong_device_names_op_label_and_device(monkeypatch):
    FakeCuda(monkeypatch, count=2, current=1)
    comm = _communicator({"cuda": "nccl"})
    with pytest.raises(C.CollectiveError, match=r"rank 1: broadcast for unit blocks\.0 got a "
                       r"tensor on cpu.*\(cuda:nccl\).*on cuda:1"):
        comm.check_devices("broadcast", "unit blocks.0", torch.zeros(2))


def test_mixed_backend_group_takes_host_tensors(monkeypatch):
    FakeCuda(monkeypatch, count=2)
    _communicator({"cpu": "gloo", "cuda": "nccl"}).check_devices("all_reduce", "",
                                                                  torch.zeros(2))


def test_every_collective_method_checks_its_tensors(monkeypatch):
    """Each tensor collective calls the check before touching the wire (the distributed
    tests then run every collective of the suite through it)."""
    FakeCuda(monkeypatch, count=1)
    comm = _communicator({"cuda": "nccl"})
    comm.world_size = 1
    comm.ledger = C.CommLedger()
    x = torch.zeros(4)
    calls = [lambda: comm.all_reduce(x), lambda: comm.broadcast(x),
             lambda: comm.reduce_scatter(torch.zeros(4), x),
             lambda: comm.all_gather(torch.zeros(4), x),
             lambda: comm.all_gather_into_many([torch.zeros(4), torch.zeros(2)],
                                               [x, torch.zeros(2)])]
    for call in calls:
        with pytest.raises(C.CollectiveError, match="got a tensor on cpu"):
            call()
    assert comm.ledger.total_bytes() == 0, "nothing may be recorded or sent"
