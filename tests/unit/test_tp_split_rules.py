"""Tensor parallelism without a process group: the split arithmetic, the AutoTP rules,
the refusals (uneven heads, what stage 3 does not do with it, sequence and pipeline
parallelism) and the layers."""
import re
from types import SimpleNamespace

import pytest
import torch

from zerotrain.config import load_config
from zerotrain.errors import ConfigError
from zerotrain.tp import SplitSpec, join_slices, local_slice, parallelize
from zerotrain.tp.layers import TensorParallelLinear
from zerotrain.tp.rules import Rules


@pytest.mark.parametrize("dim,sections", [(0, 1), (1, 1), (0, 3), (1, 2)])
def test_local_slices_join_back_and_split_each_fused_section(dim, sections):
    full = torch.arange(24 * 12, dtype=torch.float32).view(24, 12)
    spec = SplitSpec(dim, 2, sections)
    pieces = [local_slice(full, spec, t) for t in range(2)]
    assert torch.equal(join_slices(pieces, spec), full)
    section = full.shape[dim] // sections
    first = full.narrow(dim, 0, section // 2)   # rank 0 starts with half of section 0 ...
    assert torch.equal(pieces[0].narrow(dim, 0, section // 2), first)
    if sections > 1:                            # ... and then holds half of section 1
        second = full.narrow(dim, section, section // 2)
        assert torch.equal(pieces[0].narrow(dim, section // 2, section // 2), second)


def test_autotp_rules_split_projections_and_keep_the_rest_whole():
    rules = Rules()
    assert rules.rule_for("model.layers.0.self_attn.q_proj").kind == "column"
    assert rules.rule_for("model.layers.0.mlp.down_proj").kind == "row"
    assert rules.rule_for("transformer.h.1.attn.c_attn").sections == 3
    assert rules.rule_for("lm_head") is None and rules.rule_for("model.norm") is None
    custom = Rules(SimpleNamespace(use_default_specs=False, layer_specs=[
        {"patterns": [r".*\.fc_in\.weight$"], "partition_type": "column"}]))
    assert custom.rule_for("block.fc_in").kind == "column"
    assert custom.rule_for("model.layers.0.self_attn.q_proj") is None


def _llama(**kw):
    import transformers
    torch.manual_seed(0)
    args = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    args.update(kw)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**args))


def _mesh(size=2, rank=0):
    return SimpleNamespace(tp_size=size, tp_rank=rank, tp=SimpleNamespace(world_size=size))


def _tp_config(**section):
    return load_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2,
                                                                    **section}},
                       world_size=2).tensor_parallel


def test_parallelize_refuses_a_head_count_the_group_does_not_divide():
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(1\)"):
        parallelize(_llama(num_key_value_heads=1), _mesh(), _tp_config())


def test_parallelize_refuses_a_layer_whose_split_dimension_does_not_divide():
    with pytest.raises(ConfigError, match=r"mlp\.(gate|up)_proj\.weight: shape \(33, 16\)"):
        parallelize(_llama(intermediate_size=33), _mesh(), _tp_config())


def test_parallelize_gives_each_rank_its_slice_under_the_same_names():
    model = _llama()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = parallelize(model, _mesh(rank=1), _tp_config())
    local = dict(model.named_parameters())
    assert local.keys() == full.keys()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(local[q], full[q][8:])
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(local[o], full[o][:, 8:])
    assert torch.equal(local["lm_head.weight"], full["lm_head.weight"])
    assert plan.spec_of("model.norm.weight") is None


@pytest.mark.parametrize("raw,key", [
    ({"tensor_parallel": {"autotp_size": 3}}, "tensor_parallel.autotp_size"),
    ({"sequence_parallel_size": 3}, "sequence_parallel_size"),
    ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}},
     "sequence_parallel_size"),
    ({"pipeline": {"stages": 2}}, "pipeline.stages"),
    ({"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [
        {"patterns": ["x"], "partition_type": "diagonal"}]}}},
     "tensor_parallel.partition_config.layer_specs"),
])
def test_config_refuses_what_does_not_compose_by_name(raw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config({"train_batch_size": 4, **raw}, world_size=4)


def test_batch_triangle_counts_every_rank_as_deepspeed_does():
    """DeepSpeed without an ``mpu`` (AutoTP training, the Trainer) counts all N ranks."""
    tp = {"tensor_parallel": {"autotp_size": 2}}
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                       **tp}, world_size=4)
    assert cfg.train_batch_size == 24   # 2 per micro-batch x 3 x 4 ranks
    cfg = load_config({"train_batch_size": 24, "gradient_accumulation_steps": 3, **tp},
                      world_size=4)
    assert cfg.train_micro_batch_size_per_gpu == 2
    with pytest.raises(ConfigError, match=r"\* world size \(4\) = 24"):  # N/T = 2 ranks: no
        load_config({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2,
                     "gradient_accumulation_steps": 3, **tp}, world_size=4)


@pytest.mark.parametrize("zero, key", [
    ({"zero_hpz_partition_size": 2}, "zero_optimization.zero_hpz_partition_size"),
    ({"mics_shard_size": 1}, "zero_optimization.mics_shard_size"),
    ({"zero_quantized_weights": True}, "zero_optimization.zero_quantized_weights"),
    ({"zero_quantized_gradients": True}, "zero_optimization.zero_quantized_gradients"),
    (None, "'model.embed_tokens.weight' is frozen"),
])
def test_stage3_with_tensor_parallelism_refuses_what_it_does_not_do_by_name(zero, key):
    """Before any collective (``comm`` is None here): every rank refuses alike."""
    from zerotrain.engine.build import _split_tensor_parallel
    from zerotrain.tp.zero3 import check_stage3
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 3, **(zero or {})},
                       "tensor_parallel": {"autotp_size": 2}}, world_size=4)
    model = _llama()
    if zero is None:
        model.model.embed_tokens.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match=re.escape(key)):
        _split_tensor_parallel(model, cfg, None, None, None)
    plain = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 3},
                         "tensor_parallel": {"autotp_size": 2}}, world_size=4)
    check_stage3(plain.zero_optimization, _llama(), 2)   # stage 3 itself is accepted


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_a_layer_of_one_rank_computes_the_whole_linear(kind, transposed):
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 4)
    weight = linear.weight.detach().clone()
    layer = TensorParallelLinear(kind=kind, weight=weight.t().contiguous() if transposed
                                 else weight, bias=linear.bias.detach().clone(),
                                 transposed=transposed, comm=SimpleNamespace(world_size=1),
                                 name="x")
    x = torch.randn(3, 6)
    assert torch.allclose(layer(x), linear(x))


def test_the_shared_input_of_q_k_v_is_released_when_the_attention_forward_ends():
    from zerotrain.tp.layers import SharedInput
    calls = []
    comm = SimpleNamespace(world_size=2, ranks=(0, 1),
                           all_reduce=lambda t, **kw: calls.append(kw["label"]),
                           all_gather_object=lambda obj, **kw: calls.append(kw["label"]) or [
                               obj, obj])   # both ranks given the same inputs
    mesh = SimpleNamespace(tp_size=2, tp_rank=0, tp=comm)
    model = _llama()
    parallelize(model, mesh, _tp_config())
    ids = torch.randint(0, 32, (1, 4))
    model(input_ids=ids, labels=ids).loss.backward()
    shared = {id(m.shared_input): m.shared_input for m in model.modules()
              if getattr(m, "kind", None) == "column"}
    assert len(shared) == 2 and all(isinstance(s, SharedInput) for s in shared.values())
    assert all(s._seen is None for s in shared.values())   # nothing held after forward
    # one forward all-reduce (o, down) and one backward (q/k/v, gate/up) per module
    model(input_ids=ids)   # the input check ran on the first forward only
    assert sorted(calls) == sorted(
        ["tensor-parallel input check",
         "tensor parallel forward model.layers.0.self_attn.o_proj",
         "tensor parallel forward model.layers.0.mlp.down_proj",
         "tensor parallel forward model.layers.0.self_attn.o_proj",
         "tensor parallel forward model.layers.0.mlp.down_proj",
         "tensor parallel backward model.layers.0.self_attn input",
         "tensor parallel backward model.layers.0.mlp input"])


def test_inputs_that_differ_within_a_group_are_named_on_every_rank():
    from zerotrain.tp.inputs import (TensorParallelInputError, check_same_inputs,
                                     input_digests)
    ids = torch.arange(8).view(2, 4)
    mine = input_digests((), {"input_ids": ids, "labels": ids, "use_cache": False})
    same = input_digests((), {"input_ids": ids.clone(), "labels": ids, "use_cache": False})
    other = input_digests((), {"input_ids": ids + 1, "labels": ids, "use_cache": False})
    assert same == mine and other["labels"] == mine["labels"]
    assert input_digests((ids.bfloat16(),), {})["args[0]"].startswith("tensor bfloat16 (2, 4)")

    def group(*digests):
        return SimpleNamespace(world_size=len(digests), ranks=(4, 5, 6)[:len(digests)],
                               all_gather_object=lambda obj, **kw: list(digests))

    check_same_inputs(group(mine, same), (), {})
    with pytest.raises(TensorParallelInputError,
                       match=r"ranks \[4, 5, 6\].*rank 6 \(input_ids\) differ from rank 4"):
        check_same_inputs(group(mine, same, other), (), {})


def _fake_group(*digests):
    return SimpleNamespace(world_size=len(digests), ranks=tuple(range(len(digests))),
                           all_gather_object=lambda obj, **kw: list(digests))


def _batches(rank_delta):
    """The same batch in the shapes scripts pass it, with ``rank_delta`` added to one tensor
    deep inside each, or to one plain value beside it."""
    import dataclasses
    from collections import UserDict

    @dataclasses.dataclass
    class Batch:
        input_ids: torch.Tensor
        meta: dict

    class Encoding(UserDict):   # transformers' BatchEncoding is a UserDict
        pass

    ids = torch.arange(8).view(2, 4)
    moved = ids + rank_delta
    return {
        "dict": (({"input_ids": moved, "labels": ids},), {}),
        "tuple": (((ids, (moved, ids)),), {}),
        "list in kwargs": ((), {"batch": [ids, {"mask": moved}]}),
        "dataclass": ((Batch(ids, {"ids": moved}),), {}),
        "mapping": ((Encoding(input_ids=moved, attention_mask=ids),), {}),
        "int leaf": (({"input_ids": ids, "num_items": 4 + rank_delta},), {}),
        "bool leaf": ((), {"batch": {"ids": ids}, "flag": bool(rank_delta)}),
        "string leaf": (({"ids": ids, "task": "x" * (100 + rank_delta)},), {}),
    }


@pytest.mark.parametrize("kind", list(_batches(0)))
def test_different_batches_in_nested_structures_are_caught(kind):
    """A batch passed as one dict, tuple, list, dataclass or mapping (model(batch)), or with
    a differing int, bool or string inside: each is named where it differs."""
    from zerotrain.tp.inputs import TensorParallelInputError, check_same_inputs, input_digests
    mine = input_digests(*_batches(0)[kind])
    again = input_digests(*_batches(0)[kind])
    other = input_digests(*_batches(1)[kind])
    assert mine == again
    check_same_inputs(_fake_group(mine, again), (), {})
    with pytest.raises(TensorParallelInputError, match=r"rank 1 \((args\[0\]|batch|flag)"):
        check_same_inputs(_fake_group(mine, other), (), {})


def test_nested_digests_name_the_path_ignore_key_order_and_stay_bounded():
    from zerotrain.tp.inputs import _MAX_ENTRIES, input_digests
    ids = torch.arange(4)
    a = input_digests(({"input_ids": ids, "labels": ids},), {})
    b = input_digests(({"labels": ids, "input_ids": ids},), {})
    assert a == b and "args[0]['input_ids']" in a
    c = input_digests(({"input_ids": ids, "labels": ids + 1},), {})
    assert [k for k in a if a[k] != c[k]] == ["args[0]['labels']"]
    many = input_digests(([torch.tensor(i) for i in range(1000)],), {})
    fewer = input_digests(([torch.tensor(i) for i in range(999)] + [torch.tensor(-1)],), {})
    assert len(many) == _MAX_ENTRIES and many != fewer   # the folded rest still compares
    loop = {"ids": ids}
    loop["self"] = loop
    assert "not followed" in input_digests((loop,), {})["args[0]['self']"]


def test_a_traced_world_checks_no_inputs_of_fake_tensors():
    """The planner's fake world (``carries_data`` False) runs the first forward on fake
    tensors, which have no bytes to digest: the check is skipped, not an error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerotrain.tp.inputs import check_same_inputs
    asked = []
    traced = SimpleNamespace(world_size=2, ranks=(0, 1), carries_data=False,
                             all_gather_object=lambda obj, **kw: asked.append(obj) or [obj])
    with FakeTensorMode():
        ids = torch.randint(0, 8, (2, 4))
        check_same_inputs(traced, (), {"input_ids": ids, "labels": ids})
    assert asked == []
