"""A unit gather whose second launch fails (the int8 frozen chunks) waits for the first
(the in-place gather into ``full``) before the error reaches the unit, which frees
``full`` next: nothing may still be writing into the freed storage."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from zerotrain.stages.zero3 import wire as W


class _Work:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append("waited")


class _Comm:
    world_size, rank = 2, 0
    carries_data = True

    def __init__(self, log):
        self.log = log

    def gathers_flat(self, device):
        return False   # the host path: the unit's header is checked first, on its own

    def all_gather_into_many(self, outputs, inputs, *, label=""):
        self.log.append("launched")
        return _Work(self.log)

    def all_gather(self, output, input, *, label="", **kwargs):
        if label.endswith("(check)"):   # both ranks at the same unit: the headers agree
            output.view(self.world_size, -1).copy_(input.expand(self.world_size, -1))
            return None
        raise RuntimeError("connection reset by peer")   # the frozen chunks' gather


def test_a_failed_second_launch_waits_for_the_first(monkeypatch):
    log = []
    monkeypatch.setattr(W, "gather_pieces", lambda *a: ([torch.zeros(2)], [torch.zeros(1)]))
    unit = SimpleNamespace(
        shard_numel=1, device=torch.device("cpu"), slices=[], segments=[], spec=SimpleNamespace(index=0),
        shard_on_device=lambda: (torch.zeros(1), contextlib.nullcontext()),
        frozen=SimpleNamespace(packed=torch.zeros(4, dtype=torch.int8)),
        frozen_on_device=lambda: (torch.zeros(4, dtype=torch.int8), contextlib.nullcontext()))
    with pytest.raises(RuntimeError, match="connection reset"):
        W.UnitWire(_Comm(log)).start(unit, label="unit h.0")
    assert log == ["launched", "waited"]
