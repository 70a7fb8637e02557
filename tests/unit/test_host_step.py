"""The host optimizer step: its thread count (torchrun pins each rank to one thread) and
stepping each record alone instead of scanning every group per record."""
import pytest
import torch

from zerotrain.offload import Gradients, HostStorage, HostUpdater
from zerotrain.offload.threads import host_step_threads, step_alone


@pytest.mark.parametrize("environ,cores,expected", [
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8"}, 128, 16),
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "3"}, 16, 5),
    ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "1"}, 16, 16),
    ({}, 12, 12),
    ({"LOCAL_WORLD_SIZE": "32"}, 16, 1),
    # explicit user settings are kept
    ({"OMP_NUM_THREADS": "4", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8"}, 128, None),
    ({"OMP_NUM_THREADS": "1"}, 16, None),
])
def test_host_step_threads_are_cores_per_local_rank_unless_the_user_chose(environ, cores,
                                                                          expected):
    assert host_step_threads(environ, cores) == expected


class SpyAdamW(torch.optim.AdamW):
    """Records, for every step call, the thread count and how many tensors it visits."""

    calls: list = []

    def step(self, closure=None):
        SpyAdamW.calls.append((torch.get_num_threads(),
                               sum(len(g["params"]) for g in self.param_groups)))
        return super().step(closure)


def _gradients(shards: list[torch.Tensor]) -> Gradients:
    return Gradients(shards, [s.dtype for s in shards], world=1, coef=1.0)


def _records(n: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(5 + k) for k in range(n)]


def test_host_step_uses_its_thread_count_and_restores_the_callers():
    masters = _records(4)
    grads = [torch.randn_like(m) for m in masters]
    opt = SpyAdamW([{"params": masters[:2]}, {"params": masters[2:], "lr": 0.5}], lr=0.1)
    updater = HostUpdater(opt, HostStorage(False))
    before = torch.get_num_threads()
    updater.threads = before + 1
    SpyAdamW.calls = []
    updater.step(masters, _gradients(grads), publish=lambda k: None)
    assert [t for t, _ in SpyAdamW.calls] == [before + 1] * 4
    assert torch.get_num_threads() == before


def test_each_record_steps_alone_and_matches_one_optimizer_step():
    masters, expected = _records(6), _records(6)
    grads = [torch.randn_like(m) for m in masters]
    groups = lambda ts: [{"params": ts[:4]}, {"params": ts[4:], "lr": 0.5,  # noqa: E731
                                              "weight_decay": 0.0}]
    reference = torch.optim.AdamW(groups(expected), lr=0.1, fused=True)
    opt = SpyAdamW(groups(masters), lr=0.1, fused=True)
    updater = HostUpdater(opt, HostStorage(False))
    for _ in range(2):
        SpyAdamW.calls = []
        for e, g in zip(expected, grads):
            e.grad = g.clone()
        reference.step()
        updater.step(masters, _gradients([g.clone() for g in grads]), publish=lambda k: None)
        assert [n for _, n in SpyAdamW.calls] == [1] * 6, "one tensor visited per record"
    for got, want in zip(masters, expected):
        assert torch.equal(got, want)
    assert all(torch.equal(opt.state[m]["exp_avg"], reference.state[e]["exp_avg"])
               for m, e in zip(masters, expected))


def test_step_alone_writes_back_group_entries_the_step_changes():
    class Counting(torch.optim.SGD):
        def step(self, closure=None):
            self.param_groups[0]["visits"] = self.param_groups[0].get("visits", 0) + 1
            return super().step(closure)
    p = torch.zeros(3)
    opt = Counting([p], lr=1.0)
    p.grad = torch.ones(3)
    step_alone(opt, 0, p)
    assert opt.param_groups[0]["visits"] == 1 and torch.equal(p, -torch.ones(3))


def test_host_updater_takes_its_thread_count_from_the_environment(monkeypatch):
    import zerotrain.offload.updater as U
    monkeypatch.setattr(U, "available_cores", lambda: 24)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    masters = _records(1)
    assert HostUpdater(torch.optim.AdamW(masters), HostStorage(False)).threads == 6
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert HostUpdater(torch.optim.AdamW(masters), HostStorage(False)).threads is None


def test_records_step_alone_under_an_lr_scheduler_without_its_warning():
    """A scheduler wraps the optimizer instance's step (stepping all of it); the host step
    still visits one tensor per record, and the scheduler sees the optimizer stepped."""
    import warnings
    masters = _records(3)
    opt = SpyAdamW(masters, lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    updater = HostUpdater(opt, HostStorage(False))
    SpyAdamW.calls = []
    updater.step(masters, _gradients([torch.ones_like(m) for m in masters]),
                 publish=lambda k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()
    assert [n for _, n in SpyAdamW.calls] == [1, 1, 1]
    assert opt.param_groups[0]["lr"] == 0.05
