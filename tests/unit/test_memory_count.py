"""The live-storage count skips tensors that hold no memory (meta, fake, functional)."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zerotrain.core.memory import StorageLedger, live_tensor_bytes


def test_fake_tensors_left_by_compile_are_not_counted_and_do_not_break_the_count():
    real = torch.zeros(1000)                       # 4000 bytes that count
    before = live_tensor_bytes()
    with FakeTensorMode():
        fake = torch.empty(10_000)                 # what compile's caches keep alive
    meta = torch.empty(10_000, device="meta")
    assert live_tensor_bytes() == before           # no error, and nothing added
    ledger = StorageLedger()
    ledger.add("x", [real, fake, meta])
    assert ledger.bytes == {"x": real.untyped_storage().nbytes()}
    del fake, meta
