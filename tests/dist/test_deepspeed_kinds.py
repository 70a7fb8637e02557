"""What DeepSpeed code asks of an engine: which optimizer class it got, what dtype its
inputs arrive in (DeepSpeed casts them only with fp16.auto_cast)."""
import torch
from torch import nn

import reference as R


class _Recorder(nn.Module):
    """Records the dtype its input arrives in; the loss is computed in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(R.IN, R.OUT)
        self.seen = []

    def forward(self, x, y):
        self.seen.append(x.dtype)
        return (self.lin(x.to(self.lin.weight.dtype)).float() - y.float()).pow(2).mean()


def _engines(rank, world):
    import zerotrain
    from zerotrain.optim.kinds import (BF16_Optimizer, DeepSpeedZeroOptimizer,
                                       DeepSpeedZeroOptimizer_Stage3, FP16_Optimizer,
                                       ZeROOptimizer)
    classes = (BF16_Optimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3,
               FP16_Optimizer, ZeROOptimizer)
    cases = {"z0 fp32": (0, "fp32", {}), "z0 bf16": (0, "bf16", {}),
             "z1 bf16 fp32 accum": (1, "bf16", {"data_types": {"grad_accum_dtype": "fp32"}}),
             "z1 bf16": (1, "bf16", {}), "z2 fp32": (2, "fp32", {}),
             "z3 bf16": (3, "bf16", {})}
    out = {}
    for name, (stage, precision, extra) in cases.items():
        model = _Recorder()
        config = R.engine_config(stage=stage, precision=precision, **extra)
        config.get("bf16", {}).pop("auto_cast", None)   # DeepSpeed's default: no cast
        engine, *_ = zerotrain.initialize(model=model, config=config)
        x, y = R.micro_batch(0, rank, 0)
        engine.backward(engine(x, y))
        engine.step()
        out[name] = ({c.__name__ for c in classes if isinstance(engine.optimizer, c)},
                     model.seen[-1])
        engine.destroy()
    model = _Recorder()
    config = R.engine_config(stage=1, precision="bf16")   # reference: bf16.auto_cast on
    engine, *_ = zerotrain.initialize(model=model, config=config)
    engine(*R.micro_batch(0, rank, 0))
    out["opt-in cast"] = model.seen[-1]
    engine.destroy()
    return out


def test_optimizer_classes_as_deepspeed_picks_them_and_inputs_arrive_uncast(worlds):
    zero = {"ZeROOptimizer"}
    for res in worlds.run(2, _engines):
        assert res["z0 fp32"] == (set(), torch.float32)
        assert res["z0 bf16"] == ({"FP16_Optimizer"}, torch.float32)
        assert res["z1 bf16 fp32 accum"] == ({"BF16_Optimizer"} | zero, torch.float32)
        assert res["z1 bf16"] == ({"DeepSpeedZeroOptimizer"} | zero, torch.float32)
        assert res["z2 fp32"] == ({"DeepSpeedZeroOptimizer"} | zero, torch.float32)
        assert res["z3 bf16"] == ({"DeepSpeedZeroOptimizer_Stage3"} | zero, torch.float32)
        assert res["opt-in cast"] == torch.bfloat16


def _partition_cache(rank, world):
    import zerotrain
    model = R.make_model()
    config = R.engine_config(stage=3)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 20   # biases persist
    engine, *_ = zerotrain.initialize(model=model, config=config)
    persist = {n: p.ds_persist for n, p in model.named_parameters()}
    x, y = R.micro_batch(0, rank, 0)
    engine.backward(engine(x, y))
    engine.step()
    engine.empty_partition_cache()
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    engine.destroy()
    return persist, sizes


def test_ds_persist_and_empty_partition_cache(worlds):
    for persist, sizes in worlds.run(2, _partition_cache):
        assert any(persist.values()) and not all(persist.values())
        assert all((sizes[n] > 0) == persist[n] for n in persist), (persist, sizes)


def _param_offload_alone(rank, world):
    import zerotrain
    out = {}
    for name, zero in (("plain", {}), ("param offload", {"offload_param": {"device": "cpu"}})):
        model = R.make_model()
        config = R.engine_config(stage=3)
        config["zero_optimization"].update(zero)
        engine, *_ = zerotrain.initialize(model=model, config=config)
        R.train_engine(engine, steps=2, rank=rank, ga=1)
        with zerotrain.zero.GatheredParameters(list(model.parameters())):
            out[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine.destroy()
    return R.max_diff(out["plain"], out["param offload"])


def test_parameter_offload_without_optimizer_offload_matches_plain_stage3(worlds):
    """DeepSpeed allows offload_param alone (the optimizer state stays on the device)."""
    assert worlds.run(2, _param_offload_alone) == [0.0, 0.0]
