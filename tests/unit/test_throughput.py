"""engine.tput_timer (DeepSpeed's name): step counts, epochs, and samples per second from
the host clock on the CPU or from CUDA events (checked with fake events: nothing waits
while training)."""
import torch

from test_timers import FakeEvent  # 250 ms of device time per record

from zerotrain.engine.throughput import ThroughputTimer


def test_counts_and_rate_from_the_host_clock(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr("zerotrain.engine.throughput.time.perf_counter", lambda: float(next(clock)))
    timer = ThroughputTimer(batch_size=32, device=torch.device("cpu"), start_step=2)
    assert timer.avg_samples_per_sec() == float("-inf")
    for micro in range(12):                       # accumulation over 3 micro-steps
        timer.start()
        timer.stop(global_step=(micro + 1) % 3 == 0)
    assert (timer.global_step_count, timer.micro_step_count) == (4, 12)
    # step ends read the clock at steps 2, 3, 4: 2 steps of 32 samples in 2 s
    assert timer.avg_samples_per_sec() == 32.0
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0)


def test_cuda_rate_comes_from_events_without_synchronizing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a: (_ for _ in ()).throw(AssertionError("synchronized")))
    timer = ThroughputTimer(batch_size=8, device=torch.device("cuda", 0), start_step=2)
    for _ in range(6):
        timer.start()
        timer.stop(global_step=True)
    assert timer.avg_samples_per_sec() == 4 * 8 / (4 * 0.25)


def test_deepspeed_bracket_fields(monkeypatch):
    """start()/stop() as DeepSpeed's timer: nothing counts before the first start() or
    without an open bracket; brackets after start_step add their length to
    total_elapsed_time and to step_elapsed_time, which each optimizer step resets."""
    clock = iter(float(t) for t in range(1, 100))
    monkeypatch.setattr("zerotrain.engine.throughput.time.time", lambda: next(clock))
    timer = ThroughputTimer(batch_size=4, device=torch.device("cpu"), start_step=1)
    timer.stop()
    assert (timer.initialized, timer.started, timer.micro_step_count) == (False, False, 0)
    timer.start()
    assert (timer.initialized, timer.started, timer.start_time) == (True, True, 0)
    timer.stop(global_step=True)                 # step 1: before the bracket clock runs
    timer.stop(global_step=True)                 # no open bracket: not counted
    assert (timer.started, timer.global_step_count, timer.total_elapsed_time) == (False, 1, 0)
    timer.start()                                 # clock 1
    timer.stop()                                  # clock 2
    assert (timer.end_time - timer.start_time, timer.step_elapsed_time) == (1.0, 1.0)
    timer.start()                                 # clock 3
    timer.stop(global_step=True)                  # clock 4: the step resets step time
    assert (timer.micro_step_count, timer.global_step_count) == (3, 2)
    assert (timer.total_elapsed_time, timer.step_elapsed_time) == (2.0, 0.0)
