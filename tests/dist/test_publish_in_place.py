"""Stages 1-2 publish the updated shards straight into the parameters (Note: publishing in
place, stages/zero12.py), the path taken on a device, here forced on gloo: every gather's
output is a parameter's own storage unless the world leaves its last chunk padded, and
training is bitwise equal to the host path (a piece gathered into one buffer, then copied
out parameter by parameter)."""
import reference as R

STEPS = 3


def _train(rank, world, stage, precision, in_place):
    import zerotrain
    config = R.engine_config(stage=stage, ga=2, bucket=200, precision=precision)
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    default = engine.stage.publish_in_place     # the host path on gloo
    engine.stage.publish_in_place = in_place
    storages = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    seen = {"gathers": 0, "into_params": 0, "padded": 0, "launches": 0}
    gather_many = engine.comm.all_gather_into_many

    def spy(outputs, inputs, *, label=""):
        seen["launches"] += 1
        for out, inp in zip(outputs, inputs):
            seen["gathers"] += 1
            param = storages.get(out.untyped_storage().data_ptr())
            if param is not None:
                seen["into_params"] += 1
                assert out.numel() == param.numel() and out.data_ptr() == param.data_ptr()
            else:
                seen["padded"] += 1
                assert out.numel() == world * inp.numel()
        return gather_many(outputs, inputs, label=label)
    engine.comm.all_gather_into_many = spy
    R.train_engine(engine, steps=STEPS, rank=rank, ga=2)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected_padded = sum(p.numel() % world != 0 for p in model.parameters())
    engine.close()
    return {"seen": seen, "weights": weights, "expected_padded": expected_padded,
            "default": default}


def _grid(rank, world):
    out = {}
    for stage, precision in ((1, "fp32"), (2, "bf16")):
        straight = _train(rank, world, stage, precision, True)
        host = _train(rank, world, stage, precision, False)
        out[f"stage {stage} {precision}"] = {
            "seen": straight["seen"], "host_seen": host["seen"],
            "expected_padded": straight["expected_padded"], "default": host["default"],
            "diff": R.max_diff(straight["weights"], host["weights"])}
    return out


def test_stages_1_2_publish_straight_into_parameters(worlds):
    for res in worlds.run(3, _grid):
        for case, got in res.items():
            seen, params = got["seen"], 8   # TinyNet: 4 weights, 4 biases
            assert got["diff"] == 0.0, (case, got)
            assert seen["gathers"] == params * STEPS, (case, seen)
            assert seen["padded"] == got["expected_padded"] * STEPS > 0, (case, seen)
            assert seen["into_params"] == (params - got["expected_padded"]) * STEPS > 0
            assert got["host_seen"]["gathers"] == 0 and got["default"] is False, (case, got)
