"""Host <-> device copies on CPU: the values and the ledger a GPU run would produce (the
streams themselves are exercised by tests/gpu/test_cuda.py)."""
import torch

from zerotrain.offload import DeviceStorage, HostStorage, Transfers


def test_upload_sends_the_fp32_master_and_casts_on_the_device():
    transfers = Transfers(torch.device("cpu"))
    master = torch.randn(1000)
    up = transfers.upload(master, torch.bfloat16)
    assert up.dtype == torch.bfloat16 and torch.equal(up, master.to(torch.bfloat16))
    out = torch.empty(1000, dtype=torch.bfloat16)
    transfers.upload(master * 2, torch.bfloat16, out=out)
    assert torch.equal(out, (master * 2).to(torch.bfloat16))
    # fp32 crosses (4 bytes an element); the host makes no 16-bit copy (Note: the host does
    # only Adam), and on a CPU "device" no pinned staging slot is needed either
    assert transfers.ledger.snapshot() == {"calls": {"to_device": 2},
                                           "bytes": {"to_device": 2 * 4 * 1000}}
    assert transfers.host.snapshot()["upload"]["read"] == 2 * 4 * 1000
    assert len(transfers.tensors()) == 0


def test_gradients_go_down_in_the_buffer_dtype_and_shards_up_for_gathers():
    transfers = Transfers(torch.device("cpu"))
    host = torch.empty(10, dtype=torch.bfloat16)
    assert transfers.to_host(host, torch.ones(10, dtype=torch.bfloat16)) is None
    shard = torch.arange(6.0)
    sent, launch_in = HostStorage(False, transfers).send(shard, torch.device("cpu"))
    with launch_in:
        assert sent is shard
    assert transfers.ledger.nbytes == {"to_host": 20, "to_device": 24}


def test_device_storage_copies_nothing_across():
    storage = DeviceStorage(torch.device("cpu"))
    master = torch.randn(8)
    assert torch.equal(storage.upload(master, torch.bfloat16), master.to(torch.bfloat16))
    storage.send(master, torch.device("cpu"))
    assert storage.transfers.ledger.snapshot() == {"calls": {}, "bytes": {}}
