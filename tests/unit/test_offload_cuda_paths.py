"""The CUDA paths of offload's copies, run on the CPU with torch.cuda's streams and events
replaced by recorders (Notes "copy streams" and "staging a send" in offload/transfers.py):
what waits for what, what is staged, what crosses, in which dtype."""
import contextlib

import pytest
import torch

from zerotrain.offload import Transfers


class FakeStream:
    def __init__(self, *args, **kwargs):
        self.waited_streams = 0
        self.waited_events = []

    def wait_stream(self, other):
        self.waited_streams += 1

    def wait_event(self, event):
        self.waited_events.append(event)

    def synchronize(self):
        pass


class FakeEvent:
    def record(self, stream=None):
        self.stream = stream

    def synchronize(self):
        pass


@pytest.fixture
def compute(monkeypatch):
    """The compute stream; every stream, event and stream context is a recorder."""
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    return stream


def _transfers() -> Transfers:
    transfers = Transfers(torch.device("cpu"))
    transfers.cuda, transfers.pin = True, False   # the CUDA path, on host memory
    return transfers


def test_a_pageable_shard_is_staged_and_sent_without_waiting_for_compute(compute):
    transfers = _transfers()
    shard = torch.randn(1000).to(torch.bfloat16)
    on_device, context = transfers.send(shard, torch.device("cpu"))
    assert torch.equal(on_device, shard) and on_device.data_ptr() != shard.data_ptr()
    side = transfers._streams["to_device"]
    assert side.waited_streams == 0          # the copy does not queue behind compute
    assert len(compute.waited_events) == 1   # compute (and the gather after it) waits the copy
    assert isinstance(context, contextlib.nullcontext)   # the gather keeps its own order
    assert transfers.host.snapshot() == {"send_staging": {"read": 2000, "written": 2000}}
    assert transfers.ledger.nbytes["to_device"] == 2000
    assert [t.numel() for t in transfers.tensors()] == [2000]   # one pinned slot so far


def test_a_master_goes_up_in_fp32_and_is_cast_on_the_device(compute):
    transfers = _transfers()
    master = torch.randn(500)
    out = torch.empty(500, dtype=torch.bfloat16)
    transfers.upload(master, torch.bfloat16, out=out)
    assert torch.equal(out, master.to(torch.bfloat16))
    assert transfers.ledger.nbytes["to_device"] == 4 * 500   # fp32 crosses
    # pageable (pin_memory false): staged once; pinned masters are read where they live
    assert transfers.host.snapshot() == {"upload": {"read": 2000, "written": 0},
                                         "upload_staging": {"read": 2000, "written": 2000}}
    assert transfers._streams["to_device"].waited_streams == 1   # ``out`` may be in use
    assert transfers.last_upload is not None
    transfers.wait_uploads()
    assert transfers.last_upload is None
