"""Offload building blocks: the plan's checks, NVMe storage and swapping, the host updater."""
import errno
import os

import pytest
import torch

from zerotrain.config import load_config
from zerotrain.errors import ConfigError
from zerotrain.offload import (Gradients, HostStorage, HostUpdater, NvmeStorage, OffloadPlan,
                               build_param_storage)


def _g(shards) -> Gradients:
    """Finished gradients as the stage hands them over (world 1, nothing to unscale)."""
    return Gradients(list(shards), [t.dtype for t in shards], world=1, coef=1.0)


def _zero(**zero):
    return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero},
                       world_size=1).zero_optimization


@pytest.mark.parametrize("zero,key", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer.device"),
    ({"stage": 2, "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "cpu"}}, "offload_param.device"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
     "offload_optimizer.ratio"),
    ({"stage": 2, "offload_optimizer": {"dpu": True}}, "offload_optimizer.dpu"),
])
def test_plan_rejects_what_cannot_run_naming_the_key(zero, key):
    with pytest.raises(ConfigError) as err:
        OffloadPlan.from_config(_zero(**zero))
    assert err.value.path == f"zero_optimization.{key}"


def test_plan_reads_devices_and_delay():
    plan = OffloadPlan.from_config(_zero(stage=3, offload_param={"device": "cpu"},
                                         offload_optimizer={"device": "cpu", "dpu": True}))
    assert plan.optimizer_offloaded and plan.param_offloaded and plan.delayed_update
    assert not OffloadPlan.from_config(_zero(stage=2)).optimizer_offloaded


def test_nvme_path_is_created_or_refused_naming_the_key(tmp_path):
    """A missing directory is created (as DeepSpeed does); one that cannot be is a
    ConfigError naming the section's key."""
    storage = NvmeStorage(str(tmp_path / "new" / "dir"), rank=0)
    assert os.path.isdir(tmp_path / "new" / "dir")
    storage.close()
    (tmp_path / "file").write_text("")
    impossible = str(tmp_path / "file" / "sub")     # under a regular file
    with pytest.raises(ConfigError, match="cannot be created") as err:
        NvmeStorage(impossible, rank=0)
    assert err.value.path == "zero_optimization.offload_optimizer.nvme_path"
    plan = OffloadPlan.from_config(_zero(
        stage=3, offload_optimizer={"device": "cpu"},
        offload_param={"device": "nvme", "nvme_path": impossible}))
    with pytest.raises(ConfigError) as err:
        build_param_storage(plan, rank=0, device=torch.device("cpu"))
    assert err.value.path == "zero_optimization.offload_param.nvme_path"


def test_full_disk_is_a_config_error_when_space_is_reserved(tmp_path, monkeypatch):
    storage = NvmeStorage(str(tmp_path), rank=0)

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(ConfigError, match="cannot reserve .* GiB free") as err:
        storage.zeros(1000)
    assert err.value.path == "zero_optimization.offload_optimizer.nvme_path"
    storage.close()


def test_nvme_swap_round_trip(tmp_path):
    storage = NvmeStorage(str(tmp_path), rank=0, slots=2)
    a, b = storage.zeros(10), storage.zeros(7)
    assert os.listdir(storage.path) == []          # files unlinked once mapped
    a.copy_(torch.arange(10.0))
    storage.reserve_slots(17)
    storage.prefetch(0, [a, b])
    storage.swap_in(0)
    assert a.untyped_storage().data_ptr() not in storage._fds   # now in a pinned slot
    assert torch.equal(a, torch.arange(10.0))
    a.mul_(2)
    b.fill_(3)
    storage.swap_out(0)
    storage.drain()
    assert torch.equal(a, torch.arange(10.0) * 2) and torch.equal(b, torch.full((7,), 3.0))
    storage.close()
    assert not os.path.exists(storage.path)


def test_host_updater_steps_each_record_once_and_publishes_in_order():
    masters = [torch.zeros(5), torch.zeros(3)]
    opt = torch.optim.SGD(masters, lr=1.0)
    seen = []
    updater = HostUpdater(opt, HostStorage())
    updater.step(masters, _g([torch.ones(5), torch.full((3,), 2.0)]), publish=seen.append)
    assert seen == [0, 1]
    timings = updater.take_timings()
    assert {"offload_cpu_adam", "offload_publish", "offload_gradient_wait"} <= set(timings)
    assert all(seconds >= 0 for seconds in timings.values())
    assert updater.take_timings() == {}         # counting starts afresh
    assert torch.equal(masters[0], -torch.ones(5)) and torch.equal(masters[1], torch.full((3,), -2.0))
    assert all(m.grad is None for m in masters)


def test_nvme_needs_adam_state(tmp_path):
    masters = [torch.zeros(4)]
    updater = HostUpdater(torch.optim.SGD(masters, lr=0.1, momentum=0.9),
                          NvmeStorage(str(tmp_path), rank=0))
    with pytest.raises(ConfigError, match="SGD is not supported"):
        updater.attach(masters)
    updater.close()


def test_host_gradients_stay_16_bit_with_one_fp32_buffer_of_the_largest_record():
    """16-bit gradients come down into host buffers of their own dtype (2 bytes per element,
    counted by the copy ledger) and are widened to fp32 one record at a time: no
    full-size fp32 gradient copy on the host."""
    sizes = [300, 1000, 200, 700]
    masters = [torch.zeros(n) for n in sizes]
    opt = torch.optim.AdamW(masters, lr=0.1, fused=True)
    reference = [m.clone() for m in masters]
    ref_opt = torch.optim.AdamW(reference, lr=0.1)
    storage = HostStorage()
    updater = HostUpdater(opt, storage)
    for step in range(3):
        grads = [torch.randn(n, generator=torch.Generator().manual_seed(step * 10 + i))
                 .to(torch.bfloat16) for i, n in enumerate(sizes)]
        updater.step(masters, _g(grads), publish=lambda k: None)
        for r, g in zip(reference, grads):
            r.grad = g.float()
        ref_opt.step()
    held = updater.gradients.tensors()
    assert sorted(t.numel() for t in held if t.dtype == torch.bfloat16) == sorted(sizes)
    assert [t.numel() for t in held if t.dtype == torch.float32] == [max(sizes)]
    assert storage.transfers.ledger.nbytes["to_host"] == 3 * 2 * sum(sizes)
    for m, r in zip(masters, reference):
        torch.testing.assert_close(m, r, atol=1e-6, rtol=0)


def _nvme_updater(tmp_path, sizes=(6, 4)):
    storage = NvmeStorage(str(tmp_path), rank=0, slots=2)
    masters = [storage.zeros(n) for n in sizes]
    opt = torch.optim.AdamW(masters, lr=0.1, fused=True)
    updater = HostUpdater(opt, storage)
    updater.attach(masters)
    return storage, masters, opt, updater


def test_nvme_state_survives_a_load_that_drops_or_replaces_it(tmp_path):
    """A checkpoint without optimizer state clears the entries; one with state may hand in
    ordinary tensors. Either way the state returns to its reserved files: no new files,
    and Adam finds its step counter."""
    storage, masters, opt, updater = _nvme_updater(tmp_path)
    grads = [torch.ones(6), torch.ones(4)]
    updater.step(masters, _g(grads), publish=lambda k: None)
    reserved, files = storage.reserved_bytes, len(storage._fds)
    opt.state[masters[0]].clear()                                   # loaded without state
    opt.state[masters[1]]["exp_avg"] = torch.full((4,), 0.5)        # loaded with state
    updater.step(masters, _g(grads), publish=lambda k: None)
    assert storage.reserved_bytes == reserved and len(storage._fds) == files
    assert float(opt.state[masters[0]]["step"]) == 1.0              # fresh, as a new Adam
    assert float(opt.state[masters[1]]["step"]) == 2.0
    assert storage.home_of(opt.state[masters[1]]["exp_avg"]) is not None
    updater.close()


def test_a_failed_nvme_step_leaves_every_tensor_home_and_the_next_step_works(tmp_path):
    storage, masters, opt, updater = _nvme_updater(tmp_path)
    homes = [m.untyped_storage().data_ptr() for m in masters]

    def publish(k):
        raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        updater.step(masters, _g([torch.ones(6), torch.ones(4)]), publish=publish)
    assert [m.untyped_storage().data_ptr() for m in masters] == homes
    updater.step(masters, _g([torch.ones(6), torch.ones(4)]), publish=lambda k: None)
    assert all(m.untyped_storage().data_ptr() == h for m, h in zip(masters, homes))
    updater.close()
