"""The three offload storages answer every question of the ``Storage`` protocol, with the
protocol's signatures, and each answers as its placement implies."""
import inspect

import pytest
import torch

from zerotrain.offload.storage import DeviceStorage, HostStorage, NvmeStorage, Storage

MEMBERS = sorted(name for name, value in vars(Storage).items()
                 if inspect.isfunction(value) and not name.startswith("_"))


def test_protocol_lists_the_questions_stages_ask():
    assert {"memory_category", "can_alias", "steps_on_host", "finish_sends",
            "fill_from_master", "zeros", "send", "upload", "close"} <= set(MEMBERS)


@pytest.mark.parametrize("cls", [DeviceStorage, HostStorage, NvmeStorage])
def test_each_storage_has_every_member_with_the_protocol_signature(cls):
    for name in MEMBERS:
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        wanted = list(inspect.signature(getattr(Storage, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == wanted, f"{cls.__name__}.{name}{got} differs from the protocol {wanted}"


def test_answers_follow_the_placement(tmp_path):
    device, host = DeviceStorage(torch.device("cpu")), HostStorage()
    nvme = NvmeStorage(str(tmp_path), rank=0)
    try:
        assert [s.can_alias() for s in (device, host, nvme)] == [True, False, False]
        assert [s.steps_on_host() for s in (device, host, nvme)] == [False, True, True]
        assert [s.memory_category("optimizer_state") for s in (device, host, nvme)] == [
            "optimizer_state", "host_optimizer_state", "nvme_optimizer_state"]
    finally:
        nvme.close()
