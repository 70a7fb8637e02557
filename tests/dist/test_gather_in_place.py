"""Stage 3 gathers every unit straight into the buffer its parameters view.

Over one training step (forward, backward, step) at world size 3 (uneven splits, padded
segments), every gather a unit launches is spied on at the communicator: each output must
be a slice of that unit's ``full`` storage, and the launches counted by the ledger must be
one per gathered parameter piece on the host (on a device a unit's per-parameter gathers
are coalesced into one: ``tests/gpu``). A dispatch mode counts
the elements that torch operations write into any unit's ``full`` storage from Python:
none with plain gathers, hpZ's secondary gathers and host-resident shards
(``offload_param``); exactly the gathered elements with qwZ, whose int8 rows must be
decoded and written into the views. The communicator's gathers into several outputs give
the same values coalesced (forced on the host, and waited for at once) and launched one by
one (host tensors, or a backend that refuses to coalesce).
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import reference as R

CASES = {
    "fp32": {},
    "bf16 offload_param": {"precision": "bf16", "offload_param": {"device": "cpu"},
                           "offload_optimizer": {"device": "cpu"}},
    "hpz": {"zero_hpz_partition_size": 3},
    "qwz": {"zero_quantized_weights": True},
}


class WritesInto(TorchDispatchMode):
    """Counts the elements aten operations write into the given storages."""

    def __init__(self, units) -> None:
        super().__init__()
        self.units = units
        self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        if func.namespace == "aten" and schema.arguments and args:
            alias = schema.arguments[0].alias_info
            target = args[0]
            if (alias is not None and alias.is_write and isinstance(target, torch.Tensor)
                    and _storage(target) in {_storage(u.full) for u in self.units}):
                self.written += target.numel()
        return func(*args, **(kwargs or {}))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _inside(output: torch.Tensor, full: torch.Tensor) -> bool:
    start, nbytes = full.untyped_storage().data_ptr(), full.untyped_storage().nbytes()
    end = output.data_ptr() + output.numel() * output.element_size()
    return (_storage(output) == _storage(full) and start <= output.data_ptr()
            and end <= start + nbytes)


def _step(rank, world, name):
    import zerotrain
    extra = dict(CASES[name])
    precision = extra.pop("precision", "fp32")
    config = R.engine_config(stage=3, precision=precision)
    config["zero_optimization"].update(stage3_max_reuse_distance=0, **extra)
    engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    stage, units = engine.stage, engine.stage.units
    wire = stage.wire
    launches, misplaced = [], []
    for comm in {id(c): c for c in (wire.comm, getattr(wire, "secondary", wire.comm))}.values():
        def spy(outputs, inputs, *, label="", _call=comm.all_gather_into_many):
            unit = next(u for u in units
                        if label.split(" (")[0] == f"unit {u.spec.name or '<root>'}")
            launches.append(label)
            pieces.append(len(outputs))
            misplaced.extend(o.numel() for o in outputs if not _inside(o, unit.full))
            return _call(outputs, inputs, label=label)
        comm.all_gather_into_many = spy
    alone = []   # headers sent without a unit (Note "held reductions" in gather_check.py)

    def counted(output, input, *, label="", _call=wire.comm.all_gather, **kwargs):
        if label in ("held reductions (check)", "optimizer step (check)"):
            alone.append(label)
        return _call(output, input, label=label, **kwargs)
    wire.comm.all_gather = counted
    starts, pieces = [], []
    start = wire.start
    wire.start = lambda unit, *, label: (starts.append(unit.numel), start(unit, label=label))[1]
    engine.comm.ledger.reset()
    x, y = R.micro_batch(0, rank, 0)
    with WritesInto(units) as writes:
        engine.backward(engine(x, y))
        engine.step()
    calls = engine.comm.ledger.calls["all_gather"]
    engine.close()
    return {"launches": launches, "misplaced": misplaced, "written": writes.written,
            "gathers": len(starts), "gathered_numel": sum(starts), "calls": calls,
            "pieces": sum(pieces), "alone": len(alone)}


def _many(rank, world):
    """Three gathers into views of one buffer: coalesced (forced: host tensors are gathered
    one by one), one by one, and with the coalescing manager refusing; the buffers and the
    ledger's launches."""
    import zerotrain.comm.coalesced as G   # where the gathers look up _coalescing_manager
    import zerotrain.comm.communicator as C
    out = {}
    for how in ("coalesced", "host", "refused"):
        comm = C.Communicator()
        if how == "coalesced":
            comm._coalesces = lambda outputs: len(outputs) > 1 and comm._coalesce
        if how == "refused":
            comm._coalesces = lambda outputs: comm._coalesce

            def refusing(*args, **kwargs):
                raise RuntimeError("backend does not implement coalescing")
            G._coalescing_manager, saved = refusing, G._coalescing_manager
        sizes = [2, 5, 1]
        inputs = [torch.arange(n, dtype=torch.float32) + 100 * rank for n in sizes]
        buffer = torch.full((world * sum(sizes) + 1,), -1.0)
        outputs, offset = [], 1
        for n in sizes:
            outputs.append(buffer[offset: offset + world * n])
            offset += world * n
        comm.all_gather_into_many(outputs, inputs, label="test").wait()
        if how == "refused":
            G._coalescing_manager = saved
        out[how] = (buffer, dict(comm.ledger.calls), dict(comm.ledger.elements))
    return out


def _grid(rank, world):
    return {"many": _many(rank, world), **{name: _step(rank, world, name) for name in CASES}}


def test_gathers_write_into_the_units_full_buffer_without_copies(worlds):
    for per_case in worlds.run(3, _grid):
        many = per_case.pop("many")
        expected = torch.cat([-torch.ones(1)] + [torch.arange(n, dtype=torch.float32) + 100 * r
                                                 for n in (2, 5, 1) for r in range(3)])
        for how, launches in (("coalesced", 1), ("host", 3), ("refused", 3)):
            buffer, calls, elements = many[how]
            assert torch.equal(buffer, expected), how
            assert calls == {"all_gather": launches}, (how, calls)
            assert elements == {"all_gather": 3 * 8}, (how, elements)
        for name, res in per_case.items():
            assert res["gathers"] > 0, name
            if name == "qwz":   # int8 rows, decoded into the views: one write per element
                # one int8 gather each (no header), and the step's and held reductions'
                assert res["calls"] == res["gathers"] + res["alone"], (name, res)
                assert res["launches"] == [], name
                assert res["written"] == res["gathered_numel"] > 0, (name, res)
                continue
            assert len(res["launches"]) == res["gathers"], (name, res)
            # host tensors: one launch per parameter piece of each unit gather, and one
            # for its header (Note "gather check" in zero3/gather_check.py); the step and
            # held reductions have headers of their own (Note "held reductions" there)
            assert res["calls"] == res["pieces"] + res["gathers"] + res["alone"], (name, res)
            assert 1 <= res["alone"] <= 3, (name, res)
            assert res["pieces"] > res["gathers"], (name, res)
            assert res["misplaced"] == [], (name, res)
            assert res["written"] == 0, (name, res)
        assert any("(hpZ)" in label for label in per_case["hpz"]["launches"])


def test_segments_leave_room_for_the_primary_and_the_secondary_gather():
    """A parameter's segment of ``full`` holds the larger padded size of the two
    partitions it is gathered from (hpZ)."""
    from types import SimpleNamespace

    from zerotrain.stages.zero3.wire import SecondaryPartitionWire, UnitWire
    primary = SimpleNamespace(world_size=2, carries_data=True)
    secondary = SimpleNamespace(world_size=3, carries_data=True)
    sizes = (0, 1, 4, 5, 7)
    assert [UnitWire(primary).padded_numel(n) for n in sizes] == [0, 2, 4, 6, 8]
    wire = SecondaryPartitionWire(primary, secondary)
    assert [wire.padded_numel(n) for n in sizes] == [0, 3, 6, 6, 9]
