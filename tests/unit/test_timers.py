"""Step timers: CUDA events on a GPU (no synchronization while training), the host clock
on the CPU. The CUDA side is checked with fake events: nothing may call
``torch.cuda.synchronize``, and the breakdown is the events' elapsed time."""
import torch

from zerotrain.engine.timers import StepTimers


class FakeEvent:
    clock = 0.0
    recorded: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None
        self.waited = False

    def record(self, stream=None):
        FakeEvent.clock += 0.25          # each record: 250 ms of device time later
        self.at = FakeEvent.clock
        FakeEvent.recorded.append(self)

    def query(self):
        return False                     # the device is still busy

    def synchronize(self):
        self.waited = True

    def elapsed_time(self, end):
        assert end.waited, "read only after waiting for the end event"
        return (end.at - self.at) * 1e3


def test_gpu_timers_use_events_and_never_synchronize(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a: (_ for _ in ()).throw(AssertionError("synchronized")))
    FakeEvent.recorded = []
    timers = StepTimers(torch.device("cuda", 0))
    for _ in range(300):                 # past the fold threshold: unfinished events wait
        with timers.time("forward"):
            pass
    with timers.time("backward"):
        pass
    assert len(FakeEvent.recorded) == 2 * 301
    taken = timers.take()
    assert abs(taken["forward"] - 300 * 0.25) < 1e-9 and abs(taken["backward"] - 0.25) < 1e-9
    assert timers.take() == {}


def test_cpu_timers_use_the_host_clock(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", None)   # never touched on the CPU
    timers = StepTimers(torch.device("cpu"))
    with timers.time("step"):
        sum(range(1000))
    taken = timers.take()
    assert set(taken) == {"step"} and taken["step"] >= 0
