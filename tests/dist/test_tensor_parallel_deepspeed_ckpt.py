"""DeepSpeed-format checkpoints across the tensor-parallel size: a plain (T=1) ZeRO run
written as a DeepSpeed stage 1/2 save directory (``export_deepspeed``) loads into T=2 at
DP=1 and DP=2, stages 1 and 2, and a T=2 x DP=2 run written the same way loads at T=1 and
other data-parallel sizes; each continues as the run that saved it does (one process on the
global batch, ``test_tensor_parallel.py``) within 1e-5. A DeepSpeed Universal folder of the
plain run (the layout ``ds_to_universal`` writes, made here from the DeepSpeed tag) loads
into T=2 the same way."""
import os
import shutil

import pytest

from test_tensor_parallel import ROWS, _engine, _full_weights, _max_diff, _save, _steps

pytestmark = pytest.mark.slow


def _save_plain(rank, world, path):
    """T=1 x DP=2, stage 2: two steps, save, a third step."""
    engine = _engine("llama", stage=2, tp=1, micro=2)
    _steps(engine, [0, 1], 2, 1)
    engine.save_checkpoint(path, tag="two")
    saved = _full_weights(engine)
    _steps(engine, [2], 2, 1)
    third = _full_weights(engine)
    engine.destroy()
    return saved, third


def _resume_deepspeed(rank, world, path, stage, tp):
    """Load the DeepSpeed save directory ``path`` (its ``latest``) into this mesh and take
    the third step on the same global batch."""
    dp = world // tp
    micro = min(2, ROWS // dp)
    ga = ROWS // (dp * micro)
    engine = _engine("llama", stage=stage, tp=tp, micro=micro, ga=ga)
    loaded_path, _ = engine.load_checkpoint(path)
    steps = engine.global_steps
    loaded = _full_weights(engine)
    _steps(engine, [2], micro, ga)
    third = _full_weights(engine)
    engine.destroy()
    return loaded, third, steps, os.path.basename(loaded_path.rstrip("/"))


def _export(src, out, stage, world_size):
    from zerotrain.checkpoint.deepspeed.write import export_deepspeed
    export_deepspeed(src, out, stage=stage, world_size=world_size, tag="two")
    assert os.path.isfile(os.path.join(out, "global_step2", "mp_rank_00_model_states.pt"))


def test_a_plain_deepspeed_checkpoint_loads_into_tensor_parallel_meshes(worlds, tmp_path):
    """Stage 1 and 2 save directories and a Universal folder of the same plain run."""
    zt, ds1, ds2, uni = (str(tmp_path / name) for name in ("zt", "ds1", "ds2", "uni"))
    saved, third = worlds.run(2, _save_plain, zt)[0]
    _export(zt, ds1, 1, 2)
    _export(zt, ds2, 2, 2)
    _to_universal(ds2, uni)
    runs = {"stage 1, T=2 x DP=1 from DeepSpeed stage 1": worlds.run(2, _resume_deepspeed,
                                                                     ds1, 1, 2),
            "stage 2, T=2 x DP=1 from DeepSpeed stage 2": worlds.run(2, _resume_deepspeed,
                                                                     ds2, 2, 2),
            "stage 1, T=2 x DP=2 from DeepSpeed stage 2": worlds.run(4, _resume_deepspeed,
                                                                     ds2, 1, 2),
            "stage 2, T=2 x DP=2 from DeepSpeed stage 1": worlds.run(4, _resume_deepspeed,
                                                                     ds1, 2, 2),
            "stage 2, T=2 x DP=1 from a Universal folder": worlds.run(2, _resume_deepspeed,
                                                                      uni, 2, 2),
            "stage 1, T=2 x DP=2 from a Universal folder": worlds.run(4, _resume_deepspeed,
                                                                      uni, 1, 2)}
    for where, ranks in runs.items():
        for loaded, after, steps, tag in ranks:
            universal = "Universal" in where
            assert (steps, tag) == (2, "global_step2" + "_universal" * universal), where
            assert _max_diff(loaded, saved) == 0, where
            assert _max_diff(after, third) < 1e-5, where


def test_a_tensor_parallel_run_exported_to_deepspeed_loads_at_t1_and_other_dp(
        worlds, tmp_path):
    zt, ds = str(tmp_path / "zt"), str(tmp_path / "ds")
    saved, third = worlds.run(4, _save, zt)[0]
    _export(zt, ds, 2, 4)
    runs = {"stage 2, T=1 x DP=2": worlds.run(2, _resume_deepspeed, ds, 2, 1),
            "stage 1, T=1 x DP=4": worlds.run(4, _resume_deepspeed, ds, 1, 1),
            "stage 2, T=2 x DP=1": worlds.run(2, _resume_deepspeed, ds, 2, 2)}
    for where, ranks in runs.items():
        for loaded, after, steps, tag in ranks:
            assert (steps, tag) == (2, "global_step2"), where
            assert _max_diff(loaded, saved) == 0, where
            assert _max_diff(after, third) < 1e-5, where


def _to_universal(ds, out):
    """The DeepSpeed tag ``ds/global_step2`` as ``ds_to_universal`` lays it out (Note "the
    Universal layout" in ``checkpoint/deepspeed/universal.py``): the model-states file copied,
    ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` whole, ``zero/optimizer_state.pt``
    with the parameter groups, and ``latest_universal`` naming the folder."""
    import torch

    from zerotrain.checkpoint.deepspeed.source import DeepSpeedCheckpoint

    tag = os.path.join(out, "global_step2_universal")
    shutil.copytree(os.path.join(ds, "global_step2"), tag,   # the model-states files only
                    ignore=shutil.ignore_patterns("*optim_states.pt"))
    ckpt = DeepSpeedCheckpoint(os.path.join(ds, "global_step2"))
    for name in ckpt.trainable_names():
        os.makedirs(os.path.join(tag, "zero", name))
        numel = torch.Size(ckpt.full_shape(name)).numel()
        keys, step = ckpt.state_keys(name)
        for key in ["master", *keys]:
            whole = torch.empty(numel)
            ckpt.read_into(name, key, 0, numel, whole)
            file = "fp32" if key == "master" else key
            torch.save({"param": whole.view(ckpt.full_shape(name))},
                       os.path.join(tag, "zero", name, f"{file}.pt"))
        torch.save(torch.tensor(step), os.path.join(tag, "zero", name, "step.pt"))
    torch.save({"param_groups": ckpt.param_groups()},
               os.path.join(tag, "zero", "optimizer_state.pt"))
    with open(os.path.join(out, "latest_universal"), "w", encoding="utf-8") as f:
        f.write("global_step2_universal")
