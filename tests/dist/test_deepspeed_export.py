"""``zerotrain consolidate --to deepspeed``: a zerotrain checkpoint written as a DeepSpeed ZeRO
checkpoint (stage 2 and stage 3) for another world size. Always: the export read back by zerotrain's DeepSpeed
importer continues exactly as zerotrain's own checkpoint does. When DeepSpeed is importable:
the real DeepSpeed loads it with ``load_checkpoint`` and continues equal to zerotrain (fp32
within 1e-6)."""
import glob
import importlib.util
import math
import os
import re

import pytest
import torch

import reference as R

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
MICRO = 4


def _zt(stage, seed=0):
    import zerotrain
    engine, _, _, _ = zerotrain.initialize(model=R.make_model(seed),
                                           config=R.engine_config(stage=stage, micro_size=MICRO))
    return engine


def _train(engine, rank, first, steps):
    for step in range(first, first + steps):
        engine.backward(engine(*R.micro_batch(step, rank, 0, MICRO)))
        engine.step()


def _masters(engine):
    import zerotrain
    with zerotrain.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _save_job(rank, world, root):
    engine = _zt(2)
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(os.path.join(root, "zt"))


def _continue_zerotrain(rank, world, root):
    """Zerotrain resumes its own checkpoint and the export (read as DeepSpeed's), 2 steps."""
    own = _zt(1, seed=3)
    own.load_checkpoint(os.path.join(root, "zt"))
    saved = _masters(own)
    _train(own, rank, 2, 2)
    other = _zt(2, seed=4)
    other.load_checkpoint(os.path.join(root, "ds"))
    steps = other.global_steps
    _train(other, rank, 2, 2)
    return {"diff": R.max_diff(_masters(own), _masters(other)), "steps": steps,
            "own": _masters(own), "saved": saved}


def _continue_deepspeed(rank, world, root, stage):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    deepspeed.init_distributed(dist_backend="gloo")
    config = R.engine_config(stage=stage, micro_size=MICRO)
    config["optimizer"]["params"]["torch_adam"] = True
    for key in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"):
        config["zero_optimization"].pop(key)
    if stage == 3:   # the biases and the norm persist (kept whole), the weights partition
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 30
    model = R.make_model(5)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    path, _ = engine.load_checkpoint(os.path.join(root, "ds"))
    steps = engine.global_steps
    for step in range(2, 4):
        engine.backward(engine(*R.micro_batch(step, rank, 0, MICRO)))
        engine.step()
    return {"path": path, "steps": steps,
            "masters": {n: safe_get_full_fp32_param(p).detach().clone()
                        for n, p in engine.module.named_parameters()}}


def _expected_files(stage):
    if stage == 3:
        return sorted(f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
                      for r in range(3) for kind in ("model", "optim"))
    return ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                             for r in range(3)]


@pytest.mark.parametrize("stage", [2, 3])
def test_export_to_deepspeed_continues_as_zerotrain_at_another_world_size(worlds, tmp_path,
                                                                          stage):
    from zerotrain.checkpoint.deepspeed import load_file
    from zerotrain.checkpoint.full_weights import consolidate_main
    root = str(tmp_path)
    worlds.run(2, _save_job, root)
    assert consolidate_main([os.path.join(root, "zt"), os.path.join(root, "ds"), "--to",
                             "deepspeed", "--stage", str(stage), "--world-size", "3"]) == 0
    tag = open(os.path.join(root, "ds", "latest")).read()
    assert sorted(os.listdir(os.path.join(root, "ds", tag))) == _expected_files(stage)
    for name in os.listdir(os.path.join(root, "ds", tag)):
        if stage < 3:                       # plain data: no class named
            torch.load(os.path.join(root, "ds", tag, name), weights_only=True)
        else:                               # DeepSpeed's loss scaler, by class name only
            value = load_file(os.path.join(root, "ds", tag, name))
            if "optim" in name:
                scaler = value["optimizer_state_dict"]["loss_scaler"]
                assert scaler.qualname.endswith(".LossScaler"), scaler
    results = worlds.run(3, _continue_zerotrain, root)
    for res in results:
        assert res["diff"] == 0.0 and res["steps"] == 2, res
    if HAS_DEEPSPEED:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        from distributed import run_world
        if stage == 3:
            assert R.max_diff(dict(get_fp32_state_dict_from_zero_checkpoint(
                os.path.join(root, "ds"))), results[0]["saved"]) == 0.0
        for res in run_world(_continue_deepspeed, 3, root, stage, timeout=600):
            assert res["steps"] == 2, res
            assert R.max_diff(res["masters"], results[0]["own"]) <= 1e-6


def test_export_to_deepspeed_refuses_an_unknown_stage_and_a_missing_world_size(tmp_path, capsys,
                                                                                caplog,
                                                                                monkeypatch):
    import logging
    from zerotrain.checkpoint.full_weights import consolidate_main
    monkeypatch.setattr(logging.getLogger("zerotrain"), "propagate", True)
    with pytest.raises(SystemExit):
        consolidate_main([str(tmp_path), str(tmp_path / "o"), "--to", "deepspeed",
                          "--stage", "2"])
    assert "--world-size" in capsys.readouterr().err
    assert consolidate_main([str(tmp_path), str(tmp_path / "o"), "--to", "deepspeed",
                             "--stage", "4", "--world-size", "2"]) == 1
    assert "--stage 4" in caplog.text and "1, 2 and 3" in caplog.text


# ----------------------------------------------------------- exports write like saves
def _tree(folder):
    """Every file under ``folder`` (hidden ones included) with its bytes."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def test_consolidate_refuses_an_output_that_is_in_or_holds_the_tag_it_reads(worlds, tmp_path,
                                                                         caplog, monkeypatch):
    import logging
    from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint
    from zerotrain.checkpoint.full_weights import consolidate_main
    monkeypatch.setattr(logging.getLogger("zerotrain"), "propagate", True)
    root = str(tmp_path)
    worlds.run(2, _save_job, root)
    zt = os.path.join(root, "zt")
    tag = open(os.path.join(zt, "latest")).read()
    before, weights = _tree(zt), get_fp32_state_dict_from_zero_checkpoint(zt)
    os.symlink(zt, os.path.join(root, "link"))   # the checkpoint under another name
    link, inner = os.path.join(root, "link"), os.path.join(zt, tag)
    cases = {(zt, zt): "is inside the output", (zt, link): "is inside the output",
             (zt, root): "is inside the output", (zt, inner): "is the checkpoint",
             (zt, os.path.join(link, tag)): "is the checkpoint",
             (zt, os.path.join(inner, "out")): "is inside the checkpoint",
             (inner, os.path.join(link, tag, "out")): "is inside the checkpoint"}
    kinds = [["--to", "deepspeed", "--stage", "2", "--world-size", "2"],
             ["--to", "deepspeed", "--stage", "3", "--world-size", "2"], ["--to", "dcp"], []]
    for (source, output), why in cases.items():
        for kind in kinds:
            caplog.clear()
            assert consolidate_main([source, output, *kind]) == 1, (source, output, kind)
            assert why in caplog.text, (source, output, kind, caplog.text)
    assert _tree(zt) == before
    assert R.max_diff(get_fp32_state_dict_from_zero_checkpoint(zt), weights) == 0.0
    beside = os.path.join(zt, "ds")          # beside the tag (zero_to_fp32.py . out): fine
    assert consolidate_main([zt, beside, *kinds[0]]) == 0
    assert R.max_diff(get_fp32_state_dict_from_zero_checkpoint(beside), weights) == 0.0


def test_export_to_deepspeed_again_replaces_the_tag_whole_and_leaves_other_tags(
        worlds, tmp_path, monkeypatch):
    from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint
    from zerotrain.checkpoint.deepspeed import write
    from zerotrain.checkpoint.full_weights import consolidate_main
    root = str(tmp_path)
    worlds.run(2, _save_job, root)
    zt, ds = os.path.join(root, "zt"), os.path.join(root, "ds")
    weights = get_fp32_state_dict_from_zero_checkpoint(zt)
    os.makedirs(os.path.join(ds, "global_step1"))
    with open(os.path.join(ds, "global_step1", "keep.txt"), "w") as f:
        f.write("another tag")

    def export(stage, world):
        return consolidate_main([zt, ds, "--to", "deepspeed", "--stage", str(stage),
                                 "--world-size", str(world)])

    for stage, world in [(2, 3), (3, 3), (2, 2)]:   # fewer ranks, another layout, and back
        assert export(stage, world) == 0
        tag = open(os.path.join(ds, "latest")).read()
        files = sorted(os.listdir(os.path.join(ds, tag)))
        if stage == 3:
            assert files == sorted(f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
                                   for r in range(world) for kind in ("model", "optim"))
        else:
            assert files == ["mp_rank_00_model_states.pt"] + [
                f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
        assert R.max_diff(get_fp32_state_dict_from_zero_checkpoint(ds), weights) == 0.0
        assert sorted(os.listdir(ds)) == sorted(["global_step1", "latest", tag]), os.listdir(ds)
        assert _tree(os.path.join(ds, "global_step1")) == {"keep.txt": b"another tag"}
    published = _tree(ds)
    calls = []
    real_save = write.save_file

    def failing_save(value, path, **kw):   # the disk fills up after the first file
        calls.append(path)
        if len(calls) > 1:
            raise write.CheckpointError(f"cannot write {path}: No space left on device")
        return real_save(value, path, **kw)

    monkeypatch.setattr(write, "save_file", failing_save)
    assert export(2, 4) == 1 and len(calls) == 2
    assert _tree(ds) == published and sorted(os.listdir(ds)) == sorted(
        ["global_step1", "latest", tag])


# --------------------------------------------------- DeepSpeed's zero_to_fp32, stage 1-2
def _save_frozen_job(rank, world, root):
    """Stage 2, 2 ranks, 2 steps, the norm's weight frozen (a frozen parameter to export):
    613 trainable elements, which 3 and 4 ranks pad (to 618 and 616)."""
    import zerotrain
    model = R.make_model(0)
    model.norm.weight.requires_grad_(False)
    engine, _, _, _ = zerotrain.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=R.engine_config(stage=2, micro_size=MICRO))
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(os.path.join(root, "zt"))


def _natural(text):
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def _read_like_zero_to_fp32(save_dir):
    """The full fp32 state dict as DeepSpeed's ``zero_to_fp32`` rebuilds it from a stage 1-2
    checkpoint (its documented steps, redone here without DeepSpeed): ``latest`` names the
    tag; ``mp_rank_00_model_states.pt`` gives the buffers (``buffer_names`` of ``module``),
    ``param_shapes``, the frozen parameters (``frozen_param_shapes`` looked up in
    ``frozen_param_fragments``) and ``shared_params``; every ``*_optim_states.pt``, in natural
    order, gives ``optimizer_state_dict``: ``zero_stage`` (at most 2), ``partition_count``
    (the largest of a list) equal to the number of files, and
    ``single_partition_of_fp32_groups``. Each group's partitions concatenated over the ranks
    are walked in ``param_shapes`` order, and the elements consumed must match the
    concatenation's length once both are rounded up to a multiple of ``2 * world``."""
    tag = open(os.path.join(save_dir, "latest")).read().strip()
    folder = os.path.join(save_dir, tag)
    model = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), weights_only=True)
    files = sorted(glob.glob(os.path.join(folder, "*_optim_states.pt")), key=_natural)
    optims = [torch.load(f, weights_only=True)["optimizer_state_dict"] for f in files]
    assert optims[0]["zero_stage"] <= 2
    world = optims[0]["partition_count"]
    world = max(world) if isinstance(world, list) else world
    assert world == len(files), (world, files)
    out = {k: v.float() for k, v in model["module"].items() if k in model["buffer_names"]}
    for name in model.get("frozen_param_shapes") or {}:
        out[name] = model["frozen_param_fragments"][name]
    align = 2 * world
    for g, shapes in enumerate(model["param_shapes"]):
        flat = torch.cat([o["single_partition_of_fp32_groups"][g] for o in optims])
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            out[name] = flat.narrow(0, offset, numel).view(shape)
            offset += numel
        assert math.ceil(offset / align) == math.ceil(flat.numel() / align), \
            f"consumed {offset} numels out of {flat.numel()} ({world} ranks)"
    for alias, name in model["shared_params"].items():
        out[alias] = out[name]
    return out


def _check_engine_layout(save_dir, world):
    """What DeepSpeed's engine loads (a "rigid" base optimizer state): every rank's Adam
    moments span the whole partition ``P`` (torch's ``load_state_dict`` takes them as they
    are), while the fp32 partition is lean: ``P`` minus ``group_paddings`` (0 but on the last
    rank), which DeepSpeed pads back."""
    tag = open(os.path.join(save_dir, "latest")).read().strip()
    optims = [torch.load(os.path.join(save_dir, tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states"
                                      ".pt"), weights_only=True)["optimizer_state_dict"]
              for r in range(world)]
    for rank, optim in enumerate(optims):
        for g, flat in enumerate(optim["single_partition_of_fp32_groups"]):
            size = optims[0]["single_partition_of_fp32_groups"][g].numel() + \
                optims[0]["group_paddings"][g]
            assert flat.numel() + optim["group_paddings"][g] == size, (rank, g)
            assert optim["group_paddings"][g] == 0 or rank == world - 1, (rank, g)
            for key in ("exp_avg", "exp_avg_sq"):
                assert optim["base_optimizer_state"]["state"][g][key].shape == (size,), \
                    (rank, g, key)


def test_stage_1_2_export_is_what_deepspeeds_zero_to_fp32_reads(worlds, tmp_path):
    from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint
    from zerotrain.checkpoint.full_weights import consolidate_main
    root = str(tmp_path)
    worlds.run(2, _save_frozen_job, root)
    zt = os.path.join(root, "zt")
    expected = get_fp32_state_dict_from_zero_checkpoint(zt)
    assert "norm.weight" in expected
    for stage in (1, 2):
        for world in (1, 3, 4):
            out = os.path.join(root, f"ds{stage}_{world}")
            assert consolidate_main([zt, out, "--to", "deepspeed", "--stage", str(stage),
                                     "--world-size", str(world)]) == 0
            assert R.max_diff(_read_like_zero_to_fp32(out), expected) == 0.0, (stage, world)
            assert R.max_diff(get_fp32_state_dict_from_zero_checkpoint(out), expected) == 0.0
            _check_engine_layout(out, world)
            if HAS_DEEPSPEED:
                from deepspeed.utils.zero_to_fp32 import \
                    get_fp32_state_dict_from_zero_checkpoint as deepspeeds
                assert R.max_diff(dict(deepspeeds(out)), expected) == 0.0, (stage, world)
