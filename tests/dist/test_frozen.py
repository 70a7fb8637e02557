"""Frozen parameters at stage 3 (LoRA-style runs): partitioned like the rest, gathered for
forward and backward, never stepped, saved and loaded with the checkpoint, and training
matches stage 0 with the same parameters frozen."""
import pytest

import reference as R

STEPS = 3


def _freeze(model):
    """The input layer and the norm frozen, and, inside one module, a frozen weight next
    to a trainable bias."""
    for p in list(model.inp.parameters()) + list(model.norm.parameters()):
        p.requires_grad_(False)
    model.out.weight.requires_grad_(False)
    return model


def _build(stage, zero_init=False, **zero):
    import torch
    import zerotrain
    config = R.engine_config(stage=stage, ga=2, clip=0.5)
    config["zero_optimization"].update(zero)
    if zero_init:
        torch.manual_seed(0)
        with zerotrain.zero.Init():
            model = _freeze(R.TinyNet())
    else:
        model = _freeze(R.make_model())
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = zerotrain.initialize(model=model, model_parameters=trainable, config=config)
    return engine, model


def _full(model):
    import zerotrain
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank, world, zero_init):
    import torch
    plain, plain_model = _build(0)
    R.train_engine(plain, steps=STEPS, rank=rank, ga=2)
    engine, model = _build(3, zero_init=zero_init, overlap_comm=True)
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    partitioned = all(p.numel() == 0 and p.ds_numel > 0 for p in frozen.values())
    shard_elements = sum(s.layout.shard_numel for u in engine.stage.units for s in u.slices
                         if s.group is None)
    R.train_engine(engine, steps=STEPS, rank=rank, ga=2)
    got, want = _full(model), _full(plain_model)
    initial = {n: p.detach() for n, p in R.make_model().named_parameters()}
    return {"diff": R.max_diff(got, want), "partitioned": partitioned,
            "shard_elements": shard_elements,
            "frozen_elements": sum(p.ds_numel for p in frozen.values()),
            "frozen_unchanged": all(torch.equal(got[n], initial[n]) for n in frozen)}


@pytest.mark.parametrize("world,zero_init", [(2, False), (3, True)])
def test_frozen_parameters_are_partitioned_and_train_like_stage_0(worlds, world, zero_init):
    for res in worlds.run(world, _train, zero_init):
        assert res["partitioned"], res                  # no rank holds them whole
        assert res["shard_elements"] <= res["frozen_elements"] / world + 3 * world, res
        assert res["frozen_unchanged"], res
        assert res["diff"] <= 1e-6, res


def _checkpoint(rank, world, save_dir):
    import os
    from safetensors.torch import load_file
    engine, model = _build(3, stage3_gather_16bit_weights_on_model_save=True)
    R.train_engine(engine, steps=2, rank=rank, ga=2)
    engine.save_checkpoint(save_dir, tag="t")
    engine.save_16bit_model(os.path.join(save_dir, "export"))
    saved = _full(model)
    out = {}
    if rank == 0:   # the exported full weights include the frozen ones
        exported = load_file(os.path.join(save_dir, "export", "model.safetensors"))
        out["export"] = R.max_diff(exported, saved)
    for stage in (3, 2):
        again, again_model = _build(stage)
        again.load_checkpoint(save_dir, tag="t")
        out[stage] = R.max_diff(_full(again_model), saved)
    return out


def test_frozen_shards_are_saved_and_load_into_any_stage(worlds, tmp_path):
    for res in worlds.run(2, _checkpoint, str(tmp_path)):
        assert res[3] == 0.0 and res[2] == 0.0 and res.get("export", 0.0) == 0.0, res


def _groups(model):
    """DeepSpeed-Chat-style groups over all parameters, frozen ones included: the norm's
    group holds only frozen parameters (empty once they are filtered) and one group is
    empty from the start. At stage 3 the frozen norm sits in the root unit (with the
    trainable head), between the input layer's unit and the hidden layer's: backward needs
    it after the head's gradients are in, to reach the input layer."""
    norm = list(model.norm.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("norm.")]
    return [{"params": rest, "weight_decay": 0.1}, {"params": norm, "weight_decay": 0.0},
            {"params": [], "weight_decay": 0.0, "lr": 1e-3}]


def _empty_group_job(rank, world):
    import torch
    import zerotrain
    out = {}
    for stage in (0, 1, 2, 3):
        for client in (True, False):
            model = R.make_model()
            for p in model.norm.parameters():
                p.requires_grad_(False)
            config = R.engine_config(stage=stage)
            kwargs = {"model_parameters": _groups(model)}
            if client:
                del config["optimizer"]
                kwargs = {"optimizer": torch.optim.AdamW(_groups(model), lr=1e-2,
                                                         betas=(0.9, 0.95), eps=1e-8)}
            engine, *_ = zerotrain.initialize(model=model, config=config, **kwargs)
            R.train_engine(engine, steps=STEPS, rank=rank, ga=1)
            out[(stage, client)] = (_full(model), engine.get_lr())
    return out


def test_a_parameter_group_with_no_trainable_parameters_is_kept_empty(worlds):
    import torch
    reference = R.make_model()
    for p in reference.norm.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW([dict(g, params=[p for p in g["params"] if p.requires_grad])
                                   for g in _groups(reference)], lr=1e-2, betas=(0.9, 0.95),
                                  eps=1e-8)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(2):
            (reference(*R.micro_batch(step, rank, 0)) / 2).backward()
        optimizer.step()
    expected = dict(reference.named_parameters())
    for out in worlds.run(2, _empty_group_job):
        for case, (params, lrs) in out.items():
            assert lrs == [1e-2, 1e-2, 1e-3], case
            assert R.max_diff(params, expected) < 1e-6, case
