"""DeepSpeed's readers and writers of one parameter's state (``deepspeed.utils``
``safe_get_full_*`` / ``safe_set_full_*``) under tensor parallelism, stages 1-2, at
T=2 x DP=2 and T=2 x DP=1: a split parameter's value is the rank's slice, whole across
the data-parallel ranks, a replicated one the whole tensor. The slices gathered over
the tensor-parallel group equal a one-process run on the global batch (parameters,
gradients, Adam's moments, the per-group gradient norm); values written through the
setters change exactly the rank's slice (after a ``save_checkpoint`` too, whose gathered
view must not come back over them) and training goes on from them as one process goes on
from the same values."""
import pytest
import torch

import reference as R

pytestmark = pytest.mark.slow

LR = 1e-2
CLIP = 0.05   # below the gradients' norm: the written gradient changes the clipping
MICRO = 2
CASES = [("llama", 1), ("llama", 2), ("gpt2", 2)]


def _model(family):
    return R.tp_model(family)


def _batch(step, dp_rank):
    return R.tp_batch(step, dp_rank, MICRO)


def _written(names_shapes, split_name, whole_name):
    """The values both runs write after step 1: a split parameter's fp32 value and Adam
    moments, a replicated parameter's value (full shapes, the same on every rank)."""
    shapes = dict(names_shapes)
    g = torch.Generator().manual_seed(7)
    return {"param": torch.randn(shapes[split_name], generator=g) * 0.1,
            "exp_avg": torch.randn(shapes[split_name], generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(shapes[split_name], generator=g) * 1e-5,
            "whole": torch.randn(shapes[whole_name], generator=g) * 0.1}


def _names(family):
    """(a parameter the rules split, a replicated one)."""
    if family == "llama":
        return "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"
    return "transformer.h.0.attn.c_attn.weight", "transformer.wte.weight"   # fused q, k, v


def _job(rank, world, family, stage, save_to=None):
    import torch.distributed as dist

    import zerotrain
    import reference as R
    from zerotrain.errors import StateError
    from zerotrain.tp import join_slices, local_slice
    from zerotrain.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                                 safe_get_full_optimizer_state, safe_get_local_fp32_param,
                                 safe_set_full_fp32_param, safe_set_full_grad,
                                 safe_set_full_optimizer_state)
    from zerotrain.zero import GatheredParameters

    config = R.engine_config(stage=stage, clip=CLIP, lr=LR, micro_size=MICRO, bucket=200,
                             tensor_parallel={"autotp_size": 2})
    engine, *_ = zerotrain.initialize(model=_model(family), config=config)
    model, spec_of = engine.module, engine.stage.plan.spec_of
    tp_group, tp_rank = engine.stage.mesh.tp.group, engine.stage.mesh.tp_rank
    params = dict(model.named_parameters())
    out = {"shapes": {}}

    def whole(name, local):
        """What a script does: all-gather the slices over its tensor-parallel group."""
        spec = spec_of(name)
        if spec is None:
            return local.clone()
        pieces = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(pieces, local.contiguous(), group=tp_group)
        return join_slices(pieces, spec)

    def read(reader, *key):
        values = {}
        for n, p in params.items():
            local = reader(p, *key)
            out["shapes"].setdefault(n, set()).add(tuple(local.shape) == tuple(p.shape))
            values[n] = whole(n, local)
        return values

    def optimizer_views():
        """DeepSpeed's optimizer attributes hold the same slices: the whole averaged
        gradient flat, this data-parallel rank's chunk of each, the masters the inner
        optimizer steps."""
        grads = [safe_get_full_grad(p).reshape(-1) for p in params.values()]
        flat = engine.optimizer.fp32_groups_gradients_flat
        chunks = engine.optimizer.averaged_gradients
        dp, dp_rank = engine.dp_world_size, engine.get_data_parallel_rank()
        ok = len(flat) == 1 and torch.equal(flat[0], torch.cat(grads)) and list(chunks) == [0]
        for g, chunk in zip(grads, chunks[0]):
            k = -(-g.numel() // dp)
            padded = torch.cat([g, g.new_zeros(k * dp - g.numel())])
            ok = ok and torch.equal(chunk, padded[dp_rank * k:(dp_rank + 1) * k])
        masters = engine.optimizer.fp32_partitioned_groups_flat   # the inner state's keys
        inner = engine.optimizer.optimizer.state
        return ok and len(chunks[0]) == len(grads) and all(m in inner for m in masters)

    def train(step, halve=None):
        ids = _batch(step, engine.get_data_parallel_rank())
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        if step == 0:
            out["grads"] = read(safe_get_full_grad)
            out["norms"] = [float(n) for n in engine.optimizer._get_norm_groups()]
            out["views"] = optimizer_views()
        if halve is not None:
            safe_set_full_grad(params[halve], safe_get_full_grad(params[halve]) * 0.5)
        engine.step()

    for step in range(2):
        train(step)
    out["params"] = read(safe_get_full_fp32_param)
    out["exp_avg"] = read(safe_get_full_optimizer_state, "exp_avg")
    out["exp_avg_sq"] = read(safe_get_full_optimizer_state, "exp_avg_sq")
    if save_to is not None:   # a save leaves the checkpoints' view behind: the writes win
        engine.save_checkpoint(save_to, tag="before writes")

    split_name, whole_name = _names(family)
    spec, split = spec_of(split_name), params[split_name]
    values = _written([(n, tuple(t.shape)) for n, t in out["params"].items()],
                      split_name, whole_name)
    with GatheredParameters([split], modifier_rank=0):   # not partitioned: left as it is
        out["gathered"] = tuple(split.shape)
    try:
        safe_set_full_fp32_param(split, values["param"])   # the full value: refused
        out["wrong"] = "no error"
    except ValueError as exc:
        out["wrong"] = str(exc)
    try:
        safe_get_local_fp32_param(split)
        out["local"] = "no error"
    except StateError as exc:
        out["local"] = str(exc)
    before = {n: p.detach().clone() for n, p in params.items()}
    mine = {k: local_slice(values[k], spec, tp_rank) for k in ("param", "exp_avg",
                                                                "exp_avg_sq")}
    safe_set_full_fp32_param(split, mine["param"])
    out["only_slice"] = torch.equal(split.detach(), mine["param"]) and all(
        torch.equal(p.detach(), before[n]) for n, p in params.items() if n != split_name)
    safe_set_full_fp32_param(params[whole_name], values["whole"])
    out["whole_set"] = torch.equal(params[whole_name].detach(), values["whole"])
    out["roundtrip"] = {}
    for key in ("exp_avg", "exp_avg_sq"):
        safe_set_full_optimizer_state(split, mine[key], key)
        out["roundtrip"][key] = torch.equal(safe_get_full_optimizer_state(split, key),
                                            mine[key])
    train(2, halve=split_name)
    out["final"] = read(safe_get_full_fp32_param)
    engine.destroy()
    return out


def _reference(family, dp):
    """One process on the global batch, with the same writes after step 1."""
    model = _model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)
    params = dict(model.named_parameters())
    split_name, whole_name = _names(family)
    out = {}
    for step in range(3):
        if step == 2:
            values = _written([(n, tuple(p.shape)) for n, p in params.items()],
                              split_name, whole_name)
            with torch.no_grad():
                params[split_name].copy_(values["param"])
                params[whole_name].copy_(values["whole"])
            for key in ("exp_avg", "exp_avg_sq"):
                opt.state[params[split_name]][key].copy_(values[key])
        loss = sum(model(input_ids=_batch(step, r), labels=_batch(step, r)).loss
                   for r in range(dp)) / dp
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in params.items()}
            out["norm"] = float(torch.linalg.vector_norm(
                torch.cat([p.grad.reshape(-1) for p in params.values()])))
        if step == 2:
            params[split_name].grad.mul_(0.5)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        if step == 1:
            out["params"] = {n: p.detach().clone() for n, p in params.items()}
            for key in ("exp_avg", "exp_avg_sq"):
                out[key] = {n: opt.state[p][key].clone() for n, p in params.items()}
    out["final"] = {n: p.detach().clone() for n, p in params.items()}
    return out


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _all(rank, world, path):
    return {case: _job(rank, world, *case, save_to=path if case == CASES[0] else None)
            for case in CASES}


@pytest.mark.parametrize("world", [4, 2])
def test_tp_readers_and_writers_work_on_the_ranks_slice(worlds, world, tmp_path):
    dp = world // 2
    refs = {family: _reference(family, dp) for family in {f for f, _ in CASES}}
    for rank, results in enumerate(worlds.run(world, _all, str(tmp_path))):
        for (family, stage), out in results.items():
            where = (world, rank, family, stage)
            ref = refs[family]
            # every reader answers in the shape this rank's module holds
            assert all(ok == {True} for ok in out["shapes"].values()), where
            for key in ("grads", "params", "exp_avg", "exp_avg_sq", "final"):
                diff = _max_diff(out[key], ref[key])
                assert diff < 1e-5, (where, key, diff)
            assert out["norms"] == pytest.approx([ref["norm"]], rel=1e-5), where
            assert out["views"], where
            split_name, _ = _names(family)
            local = tuple(s // 2 if i == (1 if family == "gpt2" else 0) else s
                          for i, s in enumerate(ref["params"][split_name].shape))
            assert out["gathered"] == local, where
            assert out["wrong"] == (
                f"safe_set_full_fp32_param: value for {split_name} has shape "
                f"{tuple(ref['params'][split_name].shape)}; expected tensor-parallel rank "
                f"{rank % 2}'s slice {local} (of {tuple(ref['params'][split_name].shape)}, "
                f"split on dimension {1 if family == 'gpt2' else 0} over 2 ranks)"), where
            assert "stage 3" in out["local"], where
            assert out["only_slice"] and out["whole_set"], where
            assert out["roundtrip"] == {"exp_avg": True, "exp_avg_sq": True}, where
