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
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5},
      "offload_param": {"device": "cpu"}}, "offload_optimizer.ratio"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "ratio": 0.5}},
     "offload_optimizer.ratio"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5, "dpu": True}},
     "offload_optimizer.ratio"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"},
      "offload_param": {"device": "cpu", "ratio": 0.5}}, "offload_param.ratio"),
    ({"stage": 2, "offload_optimizer": {"dpu": True}}, "offload_optimizer.dpu"),
    ({"stage": 2, "offload_optimizer": {"speculative": True}}, "offload_optimizer.speculative"),
    ({"stage": 2, "offload_optimizer": {"trace_path": "/tmp/t.json"}},
     "offload_optimizer.trace_path"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "dpu": True, "speculative": True}},
     "offload_optimizer.speculative"),
])
def test_plan_rejects_what_cannot_run_naming_the_key(zero, key):
    with pytest.raises(ConfigError) as err:
        OffloadPlan.from_config(_zero(**zero))
    assert err.value.path == f"zero_optimization.{key}"


def test_offloaded_records_are_capped_for_overlap_at_stages_1_2():
    """With the optimizer on the host, a stage 1-2 record (one bucket) holds at most
    OFFLOAD_RECORD_NUMEL elements, so DeepSpeed's default 5e8 buckets do not leave a 1.42B
    model with three records (docs/offload.md, "record size"); without offload the bucket
    size is the user's."""
    from zerotrain.offload.plan import OFFLOAD_RECORD_NUMEL
    offloaded = OffloadPlan.from_config(_zero(stage=2, offload_optimizer={"device": "cpu"}))
    assert offloaded.record_numel(500_000_000) == OFFLOAD_RECORD_NUMEL == 50_000_000
    assert offloaded.record_numel(1000) == 1000
    assert OffloadPlan.from_config(_zero(stage=2)).record_numel(500_000_000) == 500_000_000


def test_ratio_keeps_the_first_records_on_the_device_as_deepspeed_splits():
    """DeepSpeed's stage 3 sends sub-group i to the host from ``int((1 - ratio) * n)`` on;
    stage 3 here places whole units (a unit's masters are one tensor), rounding down."""
    from zerotrain.offload import DeviceStorage, place_masters
    plan = OffloadPlan.from_config(_zero(stage=3, offload_optimizer={"device": "cpu",
                                                                     "ratio": 0.7}))
    assert [plan.records_on_device(n) for n in (1, 3, 10)] == [0, 0, 3]   # as DeepSpeed
    host, device = HostStorage(), DeviceStorage(torch.device("cpu"))
    records = [2, 1, 2, 2, 0, 3]   # 10 records in 6 units
    assert place_masters(plan, host, device, records) == [device, device] + [host] * 4
    most = OffloadPlan.from_config(_zero(stage=3, offload_optimizer={"device": "cpu",
                                                                     "ratio": 0.6}))
    # 4 records kept: the third unit would make 5, so whole units keep 3
    assert place_masters(most, host, device, records) == [device] * 2 + [host] * 4
    everything = OffloadPlan.from_config(_zero(stage=3, offload_optimizer={"device": "cpu",
                                                                           "ratio": 0.0}))
    assert place_masters(everything, host, device, records) == [device] * 6
    nothing = OffloadPlan.from_config(_zero(stage=3, offload_optimizer={"device": "cpu"}))
    assert place_masters(nothing, host, device, records) == [host] * 6
    assert place_masters(OffloadPlan.from_config(_zero(stage=3)), device, host,
                         records) == [device] * 6


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


def test_the_host_touches_each_element_only_for_adam_and_the_dma():
    """bf16 gradients are widened, averaged and unscaled on the device and land in fp32
    (Note "the host does only Adam"): per element and step the host's memory sees the
    landing copy (4 bytes written), Adam's own pass (gradient, master and two moments read,
    master and moments written) and the upload's read (4 bytes): no widening or cast pass,
    and the result equals the device's arithmetic bit for bit."""
    sizes = [300, 1000, 200, 700]
    masters = [torch.zeros(n) for n in sizes]
    opt = torch.optim.AdamW(masters, lr=0.1, fused=True)
    reference = [m.clone() for m in masters]
    ref_opt = torch.optim.AdamW(reference, lr=0.1, fused=True)
    storage = HostStorage()
    updater = HostUpdater(opt, storage)
    steps, world, coef = 3, 2, 0.25
    for step in range(steps):
        grads = [torch.randn(n, generator=torch.Generator().manual_seed(step * 10 + i))
                 .to(torch.bfloat16) for i, n in enumerate(sizes)]
        updater.step(masters, Gradients(grads, [torch.bfloat16] * 4, world=world, coef=coef),
                     publish=lambda k: storage.upload(masters[k], torch.bfloat16))
        for r, g in zip(reference, grads):
            r.grad = g.float().div_(world).mul_(coef)
        ref_opt.step()
    psi = sum(sizes)
    assert storage.transfers.host.snapshot() == {
        "gradient_land": {"read": 0, "written": 4 * psi * steps},
        "adam": {"read": 16 * psi * steps, "written": 12 * psi * steps},
        "upload": {"read": 4 * psi * steps, "written": 0}}
    assert storage.transfers.ledger.nbytes == {"to_host": 4 * psi * steps,
                                               "to_device": 4 * psi * steps}
    assert sorted(t.numel() for t in updater.gradients.tensors()) == sorted(sizes)
    for m, r in zip(masters, reference):
        assert torch.equal(m, r)


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


def test_delayed_update_takes_gradients_per_record_once_the_running_update_is_past_it():
    """dpu: the next backward's gradient of record k goes down as it arrives when the
    running update has stepped k (its host buffer is free), else at the step; each
    gradient goes down once, and the results are the plain delayed update's."""
    import threading
    gate = threading.Event()

    class Gated(torch.optim.SGD):
        def step(self, closure=None):
            assert gate.wait(30)
            return super().step(closure)

    masters = [torch.zeros(4), torch.zeros(3)]
    updater = HostUpdater(Gated(masters, lr=1.0), HostStorage(), delayed=True)
    updater.attach(masters)
    first = [torch.ones(4), torch.ones(3)]
    second = [torch.full((4,), 2.0), torch.full((3,), 2.0)]
    updater.step(masters, _g(first), publish=lambda k: None, order=[1, 0])
    updater.stream(1, second[1], world=1)          # the update is still at record 1
    assert not updater.gradients.fetched(1)
    gate.set()
    updater._pending.result()                       # stepped, not yet settled
    updater.stream(1, second[1], world=1)           # now its buffer is free: down at once
    assert updater.gradients.fetched(1)
    assert updater.settle()
    updater.step(masters, _g(second), publish=lambda k: None, order=[1, 0])
    assert updater.settle()
    assert torch.equal(masters[0], torch.full((4,), -3.0))
    assert torch.equal(masters[1], torch.full((3,), -3.0))
    assert updater.storage.transfers.ledger.nbytes["to_host"] == 2 * 4 * 7   # once each
    updater.close()


def test_offload_states_requests_are_checked_as_deepspeed_checks_them():
    from zerotrain.errors import StateError
    from zerotrain.offload.states import KINDS, requested_kinds
    from zerotrain.offload_names import OffloadDeviceEnum, OffloadStateTypeEnum
    assert KINDS == tuple(kind.value for kind in OffloadStateTypeEnum)
    ask = dict(param_offloaded=False, inference_only=False)
    assert requested_kinds(None, "cpu", **ask) == list(KINDS)
    assert requested_kinds([OffloadStateTypeEnum.optim_states, "lp_grads"],
                           OffloadDeviceEnum.cpu, **ask) == ["optim_states", "lp_grads"]
    assert requested_kinds(OffloadStateTypeEnum.hp_params, "cpu", **ask) == ["hp_params"]
    assert requested_kinds(None, OffloadDeviceEnum.none, **ask) is None
    with pytest.raises(ValueError, match="unknown state 'gradients'"):
        requested_kinds(["gradients"], "cpu", **ask)
    with pytest.raises(StateError, match="only 'cpu'"):
        requested_kinds(None, OffloadDeviceEnum.nvme, **ask)
    with pytest.raises(StateError, match="offload_param"):
        requested_kinds(None, "cpu", param_offloaded=True, inference_only=False)
    with pytest.raises(StateError, match="without an optimizer"):
        requested_kinds(None, "cpu", param_offloaded=False, inference_only=True)
