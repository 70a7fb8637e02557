"""torch Distributed Checkpoint (DCP) both ways, against real FSDP2 on gloo: a zerotrain
checkpoint exported to DCP continues in FSDP2 at another world size as zerotrain does, and
an FSDP2 DCP checkpoint loads into zerotrain at another stage and world size and continues
as FSDP2 does."""
import os

import pytest

import reference as R

LR = 1e-2


def _zerotrain(stage, seed=0):
    import zerotrain
    engine, _, _, _ = zerotrain.initialize(model=R.make_model(seed),
                                           config=R.engine_config(stage=stage, lr=LR))
    return engine


def _zt_train(engine, rank, first, steps):
    for step in range(first, first + steps):
        engine.backward(engine(*R.micro_batch(step, rank, 0)))
        engine.step()


def _zt_params(engine):
    import zerotrain
    with zerotrain.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _fsdp(seed=0):
    from torch.distributed.fsdp import fully_shard
    model = R.make_model(seed)
    for block in (model.inp, model.hidden, model.out):
        fully_shard(block)
    fully_shard(model)
    return model, R.adamw(model.parameters(), lr=LR)


def _fsdp_train(model, opt, rank, first, steps):
    for step in range(first, first + steps):
        model(*R.micro_batch(step, rank, 0)).backward()
        opt.step()
        opt.zero_grad()


def _fsdp_params(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {n: t.detach().clone() for n, t in full.items()}


def _fsdp_load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def _save_both(rank, world, root):
    """World 2: zerotrain saves a checkpoint, FSDP2 saves a DCP one, both after 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    engine = _zerotrain(2)
    _zt_train(engine, rank, 0, 2)
    engine.save_checkpoint(os.path.join(root, "zt"))
    model, opt = _fsdp()
    _fsdp_train(model, opt, rank, 0, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(root, "fsdp"))


def _continue_both(rank, world, root, stage):
    """World 3: each checkpoint continued by zerotrain and by FSDP2, 2 steps each."""
    out = {}
    engine = _zerotrain(1, seed=4)
    engine.load_checkpoint(os.path.join(root, "zt"))
    _zt_train(engine, rank, 2, 2)
    model, opt = _fsdp(seed=5)
    _fsdp_load(model, opt, os.path.join(root, "zt_dcp"))
    _fsdp_train(model, opt, rank, 2, 2)
    out["export"] = R.max_diff(_zt_params(engine), _fsdp_params(model))
    model, opt = _fsdp(seed=6)
    _fsdp_load(model, opt, os.path.join(root, "fsdp"))
    _fsdp_train(model, opt, rank, 2, 2)
    engine = _zerotrain(stage, seed=7)
    path, _ = engine.load_checkpoint(os.path.join(root, "fsdp"))
    out["steps"] = engine.global_steps
    _zt_train(engine, rank, 2, 2)
    out["import"] = R.max_diff(_zt_params(engine), _fsdp_params(model))
    out["path"] = os.path.basename(path)
    return out


@pytest.mark.parametrize("stage", [3])
def test_dcp_both_ways_continues_equal_to_fsdp2_at_another_world_size(worlds, tmp_path, stage):
    from zerotrain.cli import main
    root = str(tmp_path)
    worlds.run(2, _save_both, root)
    assert main(["consolidate", os.path.join(root, "zt"), os.path.join(root, "zt_dcp"),
                 "--to", "dcp"]) == 0
    assert os.path.isfile(os.path.join(root, "zt_dcp", ".metadata"))
    for res in worlds.run(3, _continue_both, root, stage):
        assert res["export"] <= 1e-6 and res["import"] <= 1e-6, res
        assert res["steps"] == 2 and res["path"] == "fsdp", res


def _moments_zerotrain(engine):
    from zerotrain.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"{name}.weight"] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = safe_get_full_optimizer_state(p, key).clone()
    return out


def _moments_fsdp(model, opt):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict)
    full = StateDictOptions(full_state_dict=True)
    weights = _fsdp_params(model)
    osd = get_optimizer_state_dict(model, opt, options=full)
    out = {}
    for name in weights:
        out[f"{name}.weight"] = weights[name]
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = osd["state"][name][key].clone()
    return out, {name: float(osd["state"][name]["step"]) for name in weights}


def _fsdp_own_loaders(rank, world, root, key):
    """FSDP2's own loading code, each state dict on its own: ``get_model_state_dict`` /
    ``get_optimizer_state_dict``, ``dcp.load`` keyed ``{"model", key}``, then
    ``set_model_state_dict`` / ``set_optimizer_state_dict``; compared with zerotrain
    resuming its own checkpoint, before and after one more step on both sides. Then the
    other way: FSDP2's checkpoint (saved under the same keys) loads into zerotrain."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    engine = _zerotrain(2, seed=4)
    engine.load_checkpoint(os.path.join(root, "zt"))
    model, opt = _fsdp(seed=5)
    state = {"model": get_model_state_dict(model), key: get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=os.path.join(root, "zt_dcp"))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state[key])
    fsdp, steps = _moments_fsdp(model, opt)
    out = {"loaded": R.max_diff(_moments_zerotrain(engine), fsdp), "steps": steps}
    _zt_train(engine, rank, 2, 1)
    _fsdp_train(model, opt, rank, 2, 1)
    out["stepped"] = R.max_diff(_moments_zerotrain(engine), _moments_fsdp(model, opt)[0])
    dcp.save({"model": get_model_state_dict(model), key: get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(root, f"fsdp_{key}"))
    back = _zerotrain(2, seed=6)
    back.load_checkpoint(os.path.join(root, f"fsdp_{key}"))
    out["imported"] = R.max_diff(_moments_zerotrain(back), _moments_fsdp(model, opt)[0])
    out["imported_steps"] = back.global_steps
    return out


def test_dcp_export_loads_through_fsdp2_model_and_optimizer_state_dict_helpers(worlds,
                                                                              tmp_path):
    from zerotrain.cli import main
    root = str(tmp_path)
    worlds.run(2, _save_both, root)
    assert main(["consolidate", os.path.join(root, "zt"), os.path.join(root, "zt_dcp"),
                 "--to", "dcp"]) == 0
    for key in ("optim", "optimizer"):      # torch's DCP recipe names it optim, torchtitan
        for res in worlds.run(2, _fsdp_own_loaders, root, key):    # optimizer
            assert res["loaded"] == 0.0 and res["stepped"] <= 1e-6, (key, res)
            assert set(res["steps"].values()) == {2.0}, res
            assert res["imported"] == 0.0 and res["imported_steps"] == 3, (key, res)
