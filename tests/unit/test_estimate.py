"""Tests for zerotrain.estimate: the ZeRO table, offload, model counting, the recommendation,
and DeepSpeed's estimator API, all without a process group."""
from __future__ import annotations

import json
import logging
import textwrap
import warnings

import pytest

from zerotrain.config import load_config
from zerotrain.offload.plan import OffloadPlan
from zerotrain.estimate import (
    Budget, EstimateRequest, ModelShape, Placement, activation_bytes, ds_config, estimate,
    estimate_zero2_model_states_mem_needs_all_cold, estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs_all_cold, estimate_zero3_model_states_mem_needs_all_live,
    fp32_accumulation_extra, model_states, parse_bytes, parse_count, recommend,
    shape_from_hf_config, shape_from_module_spec)

GB, GIB = 10**9, 2**30
SEVEN_B = 7 * 10**9


def rows_by_label(rows):
    return {row.placement: row for row in rows}


# ------------------------------------------------------------------ the ZeRO table
def test_seed_example_7b_on_8_gpus_mixed_precision_adam_is_exact():
    rows = rows_by_label(model_states(SEVEN_B, gpus_per_node=8))
    totals = [rows[Placement(stage)].gpu_total for stage in range(4)]
    assert totals == [112 * GB, 38.5 * GB, 26.25 * GB, 14 * GB]
    z2 = rows[Placement(2)]
    assert (z2.gpu_params, z2.gpu_grads, z2.gpu_optimizer) == (14 * GB, 1.75 * GB, 10.5 * GB)
    assert [rows[Placement(s)].formula for s in range(4)] == [
        "16Ψ", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N"]
    assert all(rows[Placement(s)].host_per_node == 0 for s in range(4))


def test_fp32_training_keeps_no_master_copy():
    rows = rows_by_label(model_states(SEVEN_B, gpus_per_node=8, dtype="fp32"))
    dp = rows[Placement(0)]
    assert (dp.gpu_params, dp.gpu_grads, dp.gpu_optimizer) == (28 * GB, 28 * GB, 56 * GB)
    assert rows[Placement(1)].gpu_total == 28 * GB + 28 * GB + 7 * GB
    assert rows[Placement(3)].gpu_total == 16 * SEVEN_B / 8


@pytest.mark.parametrize("dtype, per_param", [("bf16", (2, 2, 8)), ("fp16", (2, 2, 8)),
                                              ("fp32", (4, 4, 4))])
def test_sgd_with_momentum_keeps_4_bytes_plus_master_in_mixed_precision(dtype, per_param):
    dp = rows_by_label(model_states(1000, gpus_per_node=4, dtype=dtype,
                                    optimizer="sgd"))[Placement(0)]
    assert (dp.gpu_params, dp.gpu_grads, dp.gpu_optimizer) == tuple(1000 * b for b in per_param)


def test_offload_rows_move_the_optimizer_and_params_to_each_node():
    # zerotrain's layout (states.py, Note "offload"), 7B on 2 nodes x 8 GPUs (N = 16), bf16,
    # Adam: the host holds the fp32 master + moments, 4 + 8 = 12 bytes per parameter of each
    # shard, with no fp32 gradient copy; the gradient shard stays on the GPU in 16 bits.
    # A node's 8 GPUs hold 8/16 of the states, so per node = bytes per parameter * Ψ / 2.
    rows = rows_by_label(model_states(SEVEN_B, gpus_per_node=8, nodes=2))
    z2_cpu = rows[Placement(2, "cpu")]
    assert (z2_cpu.gpu_params, z2_cpu.gpu_grads, z2_cpu.gpu_optimizer) == (
        2 * SEVEN_B, 2 * SEVEN_B / 16, 0)                     # 2Ψ + 2Ψ/N = 14 + 0.875 GB
    assert z2_cpu.formula == "2Ψ + 2Ψ/N"
    assert z2_cpu.host_per_node == 12 * SEVEN_B / 2           # 42 GB
    z3_cpu = rows[Placement(3, "cpu")]
    assert z3_cpu.gpu_total == 4 * SEVEN_B / 16 and z3_cpu.formula == "4Ψ/N"  # 1.75 GB
    assert z3_cpu.host_per_node == 12 * SEVEN_B / 2 and z3_cpu.nvme_per_node == 0
    z3_both = rows[Placement(3, "cpu", "cpu")]                # + the 2-byte parameter shard
    assert z3_both.gpu_params == 0 and z3_both.gpu_total == 2 * SEVEN_B / 16  # 0.875 GB
    assert z3_both.host_per_node == (12 + 2) * SEVEN_B / 2   # 49 GB
    nvme = rows[Placement(3, "nvme", "cpu")]   # parameters never go to NVMe in zerotrain
    assert nvme.gpu_total == 2 * SEVEN_B / 16
    assert nvme.host_per_node == 2 * SEVEN_B / 2 and nvme.nvme_per_node == 12 * SEVEN_B / 2
    assert Placement(3, "nvme", "nvme") not in rows
    assert nvme.placement.label == "ZeRO-3, optimizer on NVMe, params on CPU"


@pytest.mark.parametrize("dtype, optimizer, host, gpu_z3_cpu", [
    ("bf16", "sgd", 4 + 4, 2 + 2),   # fp32 master + momentum; 16-bit params and grads
    ("fp32", "adam", 4 + 8, 4 + 4),  # the host master copies the GPU's fp32 weights
    ("fp32", "sgd", 4 + 4, 4 + 4)])
def test_offload_host_bytes_are_master_plus_moments_in_every_dtype(dtype, optimizer, host,
                                                                   gpu_z3_cpu):
    rows = rows_by_label(model_states(1600, gpus_per_node=4, nodes=2, dtype=dtype,
                                      optimizer=optimizer))
    z3_cpu = rows[Placement(3, "cpu")]
    assert z3_cpu.host_per_node == host * 1600 / 2 and z3_cpu.gpu_total == gpu_z3_cpu * 1600 / 8
    param_bytes = 4 if dtype == "fp32" else 2
    assert rows[Placement(3, "cpu", "cpu")].host_per_node == (host + param_bytes) * 1600 / 2
    assert (Placement(3, "nvme", "cpu") in rows) == (optimizer == "adam")  # NVMe swaps Adam


def test_fp32_gradient_accumulation_extra_is_2_psi_full_or_sharded():
    assert fp32_accumulation_extra(SEVEN_B, Placement(1), world=8, dtype="bf16") == 14 * GB
    assert fp32_accumulation_extra(SEVEN_B, Placement(2), world=8, dtype="bf16") == 1.75 * GB
    assert fp32_accumulation_extra(SEVEN_B, Placement(3), world=8, dtype="fp32") == 0
    # offload keeps the gradients on the GPU, so the extra stays
    assert fp32_accumulation_extra(SEVEN_B, Placement(3, "cpu"), world=8, dtype="bf16") == 1.75 * GB
    assert fp32_accumulation_extra(SEVEN_B, Placement(1, "cpu"), world=8, dtype="bf16") == 14 * GB


def test_rendered_table_shows_the_seed_numbers_and_says_activations_come_on_top():
    text = estimate(EstimateRequest(SEVEN_B, gpus_per_node=8)).render()
    for label, total in [("data parallel (stage 0)", "112"), ("ZeRO-1", "38.5"),
                         ("ZeRO-2", "26.25"), ("ZeRO-3", "14")]:
        line = next(l for l in text.splitlines() if l.startswith(label + " "))
        assert f" {total} " in line
    assert "Activations" in text and "come on top" in text
    assert "grad_accum_dtype" in text


# ------------------------------------------------------------------ sizes
@pytest.mark.parametrize("text, count", [("7B", 7 * 10**9), ("1.3b", 1_300_000_000),
                                         ("350M", 350_000_000), ("125k", 125_000),
                                         ("7e9", 7 * 10**9), ("1_000", 1000)])
def test_parse_count(text, count):
    assert parse_count(text) == count


@pytest.mark.parametrize("text, nbytes", [("80GB", 80 * GB), ("512GiB", 512 * GIB),
                                          ("1.5TB", 1_500 * GB), ("24 gib", 24 * GIB)])
def test_parse_bytes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("parse, text, words", [
    (parse_count, "7X", "suffix"), (parse_count, "", "not a number"),
    (parse_count, "-1B", "not a number"), (parse_count, "0.1", "less than one"),
    (parse_bytes, "80", "no unit"), (parse_bytes, "80XB", "unknown unit"),
    (parse_bytes, "0GB", "more than 0"),
    (parse_count, "1e308T", "more than 1000T"), (parse_count, "1001T", "more than 1000T"),
    (parse_bytes, "1e300TiB", "more than 1 EB"), (parse_bytes, "1e19B", "more than 1 EB")])
def test_bad_sizes_explain_themselves(parse, text, words):
    with pytest.raises(ValueError, match=words):
        parse(text)


# ------------------------------------------------------------------ counting models
GPT2 = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
        "n_layer": 12, "n_head": 12}
LLAMA2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "tie_word_embeddings": False}
TINYLLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
             "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "tie_word_embeddings": False}


def _write(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("config, expected", [
    (GPT2, 124_439_808),          # GPT-2 small, as published
    (LLAMA2_7B, 6_738_415_616),   # Llama-2-7b
    (TINYLLAMA, 1_100_048_384),   # TinyLlama-1.1B, grouped-query attention
])
def test_hf_config_counts_match_published_sizes(tmp_path, config, expected):
    shape = shape_from_hf_config(_write(tmp_path, config))
    assert shape.total_params == expected
    assert shape.largest_layer_params == config["vocab_size"] * shape.hidden_size
    assert shape.has_transformer_shape


def test_hf_config_hand_count_of_a_tiny_llama_with_tied_head_and_biases(tmp_path):
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 4, "intermediate_size": 6,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "tie_word_embeddings": True, "attention_bias": True}
    head_dim = 2
    attention = 4 * 4 + 2 * 4 * 2 + 4 * 4 + (4 + 2 * 2) + 4  # q, k+v, o, qkv bias, o bias
    per_layer = attention + 3 * 4 * 6 + 2 * 4
    assert head_dim * 2 == 4
    assert shape_from_hf_config(_write(tmp_path, cfg)).total_params == 10 * 4 + 2 * per_layer + 4


@pytest.mark.parametrize("config", [GPT2, TINYLLAMA])
def test_hf_config_count_matches_transformers_when_installed(tmp_path, config):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    _write(tmp_path, config)
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert shape_from_hf_config(tmp_path / "config.json").total_params == sum(
        p.numel() for p in model.parameters())


def test_hf_config_refuses_what_it_cannot_count(tmp_path):
    with pytest.raises(ValueError, match="module:callable"):
        shape_from_hf_config(_write(tmp_path, {"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        shape_from_hf_config(_write(tmp_path, {**TINYLLAMA, "num_local_experts": 8}))


MODULE_SOURCE = textwrap.dedent("""
    from torch import nn

    def small():
        tied = nn.Linear(20, 20, bias=False)
        return nn.Sequential(nn.Linear(10, 20), tied, tied, nn.Linear(20, 5))

    def huge():  # 10^10 parameters: 40 GB if it were allocated
        return nn.Linear(100_000, 100_000, bias=False)

    def needs_args(width):
        return nn.Linear(width, width)
""")


def test_module_callable_is_built_on_meta_and_shared_params_count_once(tmp_path, monkeypatch):
    (tmp_path / "toy_models.py").write_text(MODULE_SOURCE)
    monkeypatch.chdir(tmp_path)
    shape = shape_from_module_spec("toy_models:small")
    assert shape.total_params == (10 * 20 + 20) + 20 * 20 + (20 * 5 + 5)
    assert shape.largest_layer_params == 400
    assert shape_from_module_spec(str(tmp_path / "toy_models.py") + ":huge").total_params == 10**10
    with pytest.raises(ValueError, match="has no attribute"):
        shape_from_module_spec("toy_models:missing")
    with pytest.raises(ValueError, match="module:callable"):
        shape_from_module_spec("toy_models")
    with pytest.raises(ValueError, match="calling it on the meta device failed: TypeError"):
        shape_from_module_spec("toy_models:needs_args")


def test_activation_formula_is_korthikanti_per_layer_plus_fp32_logits():
    shape = ModelShape(0, 0, hidden_size=4096, num_layers=32, num_heads=32, vocab_size=32000)
    s, b, h = 2048, 1, 4096
    layer = s * b * h * (34 + 5 * 32 * s / h)
    logits = 4 * s * b * 32000
    assert activation_bytes(shape, micro_batch=b, seq_len=s, dtype="bf16",
                            checkpointing=False) == 32 * layer + logits
    assert activation_bytes(shape, micro_batch=b, seq_len=s, dtype="bf16",
                            checkpointing=True) == 2 * s * b * h * 32 + layer + logits
    assert activation_bytes(shape, micro_batch=b, seq_len=s, dtype="bf16", checkpointing=False,
                            fused_attention=True) == 32 * s * b * h * 34 + logits
    assert activation_bytes(shape, micro_batch=b, seq_len=s, dtype="fp32",
                            checkpointing=False) == 2 * 32 * layer + logits


# ------------------------------------------------------------------ recommendation
def _recommend(params, gpus, gpu_memory, cpu_memory=None, nodes=1):
    report = estimate(EstimateRequest(params, gpus_per_node=gpus, nodes=nodes,
                                      gpu_memory=parse_bytes(gpu_memory),
                                      cpu_memory=parse_bytes(cpu_memory) if cpu_memory else None))
    return report.recommendation.placement


@pytest.mark.parametrize("params, gpus, gpu_memory, cpu_memory, expected", [
    ("125M", 8, "80GB", None, Placement(1)),          # ample room: ZeRO-1
    ("7B", 8, "80GB", None, Placement(2)),            # "start with ZeRO-2"
    ("13B", 8, "40GB", None, Placement(3)),           # ZeRO-2 needs 42.3 GB, ZeRO-3 29.25
    # need* at ZeRO-3 + optimizer on CPU = 2Ψ/N params + 4Ψ/N fp32-accumulated gradients
    ("3B", 1, "24GB", None, Placement(3, "cpu")),     # one GPU: 6Ψ = 18 GB <= 19.2
    ("7B", 1, "24GB", None, None),                    # 4Ψ = 28 GB even with params on CPU
    ("70B", 8, "80GB", "2TB", Placement(3, "cpu")),   # 6Ψ/N = 52.5 GB; host 12Ψ = 840 GB
    # 6Ψ/N = 90 GB > 64; params on CPU too: 4Ψ/N = 60 GB, host 14Ψ = 420 GB
    ("30B", 2, "80GB", "2TB", Placement(3, "cpu", "cpu")),
    # host 12Ψ = 840 GB and 14Ψ = 980 GB > 409.6; optimizer on NVMe: host 2Ψ = 140 GB
    ("70B", 8, "80GB", "512GB", Placement(3, "nvme", "cpu")),
])
def test_recommendation_picks_the_lowest_stage_that_fits(params, gpus, gpu_memory, cpu_memory,
                                                         expected):
    assert _recommend(parse_count(params), gpus, gpu_memory, cpu_memory) == expected


def test_recommendation_skips_nvme_for_sgd_and_reports_both_off_gpu_shares():
    def rec(optimizer):
        return estimate(EstimateRequest(SEVEN_B * 10, gpus_per_node=8, optimizer=optimizer,
                                        gpu_memory=80 * GB, cpu_memory=512 * GB))
    adam = rec("adam")
    assert adam.recommendation.placement == Placement(3, "nvme", "cpu")
    assert "140 GB per node on CPU and 840 GB on NVMe" in adam.recommendation.reason
    assert "nvme_path" in adam.render()
    assert rec("sgd").recommendation.placement is None  # zerotrain swaps only Adam to NVMe


def test_recommendation_tries_activation_checkpointing_before_a_higher_stage():
    rows = model_states(SEVEN_B, gpus_per_node=8)
    budget = Budget(80 * GB, activations=50 * GB, activations_checkpointed=5 * GB)
    rec = recommend(rows, budget, total_params=SEVEN_B, world=8, dtype="bf16")
    assert rec.placement == Placement(2) and rec.checkpointing
    nothing = recommend(rows, Budget(8 * GB, activations=50 * GB, activations_checkpointed=9 * GB),
                        total_params=SEVEN_B, world=8, dtype="bf16")
    assert nothing.placement is None and "add GPUs" in nothing.reason


@pytest.mark.parametrize("placement", [Placement(1), Placement(2), Placement(3),
                                       Placement(2, "cpu"), Placement(3, "cpu"),
                                       Placement(3, "cpu", "cpu"), Placement(3, "nvme", "cpu")])
@pytest.mark.parametrize("dtype, optimizer", [("bf16", "adam"), ("fp16", "sgd"),
                                              ("fp32", "adam")])
def test_recommended_configs_load_without_warnings(placement, dtype, optimizer):
    config = ds_config(placement, dtype=dtype, optimizer=optimizer, micro_batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DeepSpeed-only keys either
        loaded = load_config(json.loads(json.dumps(config)), world_size=8)
    assert loaded.zero_optimization.stage == placement.stage
    assert loaded.precision == dtype
    offload = loaded.zero_optimization.offload_optimizer
    assert (offload.device if offload else "none") == placement.offload_optimizer
    params = loaded.zero_optimization.offload_param
    assert (params.device if params else "none") == placement.offload_param
    plan = OffloadPlan.from_config(loaded.zero_optimization)  # zerotrain's offload checks
    assert (plan.optimizer, plan.param) == (placement.offload_optimizer, placement.offload_param)


# ------------------------------------------------------------------ DeepSpeed's API
class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def captured():
    handler = _Capture()
    logger = logging.getLogger("zerotrain.estimate")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def _gib(rows):
    return [(round(r.cpu_bytes / GIB, 2), round(r.gpu_bytes / GIB, 2)) for r in rows]


def test_deepspeed_zero3_estimate_matches_its_documented_example(captured):
    # docs/code-docs/source/memory.rst: 2851M params, 32M largest layer, 1 node x 8 GPUs
    rows = estimate_zero3_model_states_mem_needs_all_cold(total_params=2851e6,
                                                          largest_layer_params=32e6,
                                                          num_gpus_per_node=8, num_nodes=1)
    assert _gib(rows) == [(71.69, 0.12), (127.45, 0.12), (63.72, 0.78), (127.45, 0.78),
                          (1.43, 6.09), (127.45, 6.09)]
    assert [(r.offload_param, r.offload_optimizer, r.zero_init) for r in rows][:3] == [
        ("cpu", "cpu", True), ("cpu", "cpu", False), ("none", "cpu", True)]
    assert "2851M total params, 32M largest layer params" in captured[-1]
    assert "offload_param=cpu , offload_optimizer=cpu , zero_init=1" in captured[-1]


def test_deepspeed_zero2_estimate_matches_its_current_formula(captured):
    rows = estimate_zero2_model_states_mem_needs_all_cold(total_params=2851e6,
                                                          num_gpus_per_node=8, num_nodes=1)
    # The offload row is the documented 127.45 GB / 5.31 GB. Without offload DeepSpeed now
    # computes 2Ψ + 18Ψ/N (PR #5099); its docs' 15.93 GB came from the older 4Ψ + 16Ψ/N.
    assert _gib(rows) == [(127.45, 5.31), (127.45, 11.28)]
    assert round((4 * 2851e6 + 16 * 2851e6 / 8) / GIB, 2) == 15.93
    assert "offload_optimizer=cpu" in captured[-1] and "offload_optimizer=none" in captured[-1]


def test_deepspeed_live_estimators_count_a_module_like_model_to_params():
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 64))
    z2 = estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    z3 = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    total, largest = 1000 * 64 + 64 * 64 + 64, 64_000
    assert z2 == estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=2)
    assert z3 == estimate_zero3_model_states_mem_needs_all_cold(total, largest,
                                                                num_gpus_per_node=2)


def test_notes_count_hpz_secondary_copy_per_gpu_count():
    text = " ".join(estimate(EstimateRequest(SEVEN_B, gpus_per_node=8, nodes=2)).render().split())
    assert "secondary parameter copy of 2Ψ/H bytes per GPU: +1.75 GB with H = 8" in text
    fp32 = " ".join(estimate(EstimateRequest(SEVEN_B, gpus_per_node=4,
                                             dtype="fp32")).render().split())
    assert "copy of 4Ψ/H bytes per GPU: +7 GB with H = 4" in fp32
    single = estimate(EstimateRequest(SEVEN_B, gpus_per_node=1)).render()
    assert "hpZ" not in single


# ------------------------------------------------------------------ tensor parallelism
@pytest.mark.parametrize("tp, gpus", [(2, 8), (4, 8), (8, 8), (2, 4)])
def test_tensor_parallel_rows_are_the_docs_table_when_all_is_split(tp, gpus):
    """docs/tensor-parallel.md, "Memory per rank" (bf16, Adam, Ψ_r = 0): 16Ψ/T at stage 0,
    4Ψ/T + 12Ψ/N at stage 1, 2Ψ/T + 14Ψ/N at stage 2; stage 3 16Ψ/N."""
    psi, n = SEVEN_B, gpus
    rows = rows_by_label(model_states(psi, gpus_per_node=gpus, tp=tp))
    expected = [16 * psi / tp, 4 * psi / tp + 12 * psi / n, 2 * psi / tp + 14 * psi / n,
                16 * psi / n]
    for stage, want in enumerate(expected):
        assert rows[Placement(stage)].gpu_total == pytest.approx(want, rel=1e-12), stage
    z2 = rows[Placement(2)]
    assert (z2.gpu_params, z2.gpu_grads, z2.gpu_optimizer) == pytest.approx(
        (2 * psi / tp, 2 * psi / n, 12 * psi / n), rel=1e-12)
    assert rows[Placement(2)].formula == "2Ψ_T + 14Ψ_T/D"
    # offload: the host keeps the rank's shard of Ψ_T, 12 bytes each, for each GPU of the node
    assert rows[Placement(2, "cpu")].host_per_node == pytest.approx(12 * psi / n * gpus)


def test_tensor_parallel_replicated_parameters_stay_whole_on_every_rank():
    """Ψ_T = Ψ_s/T + Ψ_r and D = N/T: the replicated part is not divided by T; at stage 3
    split parts / (T·D), replicated ones / D."""
    psi, split, tp, gpus = 1000, 800, 2, 8
    dp, per_rank = gpus // tp, 800 / 2 + 200
    rows = rows_by_label(model_states(psi, gpus_per_node=gpus, tp=tp, split_params=split))
    assert rows[Placement(0)].gpu_total == 16 * per_rank
    assert rows[Placement(1)].gpu_total == 4 * per_rank + 12 * per_rank / dp
    assert rows[Placement(2)].gpu_total == 2 * per_rank + 14 * per_rank / dp
    assert rows[Placement(3)].gpu_total == pytest.approx(16 * (split / (tp * dp)
                                                               + (psi - split) / dp))
    assert fp32_accumulation_extra(psi, Placement(1), world=gpus, dtype="bf16", tp=tp,
                                   split_params=split) == 2 * per_rank
    assert fp32_accumulation_extra(psi, Placement(2), world=gpus, dtype="bf16", tp=tp,
                                   split_params=split) == 2 * per_rank / dp
    # T = 1 is the plain table
    assert model_states(psi, gpus_per_node=gpus, tp=1, split_params=split) == model_states(
        psi, gpus_per_node=gpus)


@pytest.mark.parametrize("tp, gpus, words", [(3, 8, "does not divide the 8 GPUs"),
                                             (0, 8, "at least 1")])
def test_tensor_parallel_size_the_gpus_do_not_divide_is_refused(tp, gpus, words):
    with pytest.raises(ValueError, match=words):
        model_states(SEVEN_B, gpus_per_node=gpus, tp=tp)


def test_tensor_parallel_split_follows_the_autotp_rules_on_a_meta_model(tmp_path):
    """Ψ_s of a tiny Llama and GPT-2 = the weights (and column biases) of the layers the
    rules split; embeddings, norms and lm_head are replicated."""
    from zerotrain.planner.tp_split import split_of_model_spec

    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    total, split, heads = split_of_model_spec(str(llama))
    kv = 2 * 4   # k, v: 2 heads of 4
    per_layer = 16 * 16 + 2 * 16 * kv + 16 * 16 + 3 * 16 * 32
    assert split == 2 * per_layer
    assert total - split == 2 * 64 * 16 + 2 * 2 * 16 + 16   # embed, lm_head, norms
    assert heads == {"num_attention_heads": 4, "num_key_value_heads": 2}
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 64, "n_embd": 16,
                                "n_layer": 1, "n_head": 4, "n_positions": 32}))
    total, split, _ = split_of_model_spec(str(gpt2))
    # c_attn (w + b), c_proj (w; its bias is added once), c_fc (w + b), mlp c_proj (w)
    assert split == (16 * 48 + 48) + 16 * 16 + (16 * 64 + 64) + 64 * 16


def test_tensor_parallel_divides_activations_inside_split_layers():
    """Korthikanti et al. eq. 3: s·b·h·(10 + 24/T + 5as/(hT)) per layer; logits whole."""
    shape = ModelShape(total_params=1, largest_layer_params=1, hidden_size=64, num_layers=2,
                       num_heads=4, vocab_size=100)
    s, b, h, a = 32, 2, 64, 4
    for tp in (1, 2, 4):
        got = activation_bytes(shape, micro_batch=b, seq_len=s, dtype="bf16",
                               checkpointing=False, tp=tp)
        assert got == pytest.approx(2 * s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
                                    + 4 * s * b * 100)


def test_tensor_parallel_report_recommends_stage_3_where_only_it_fits_and_writes_the_size():
    report = estimate(EstimateRequest(SEVEN_B, gpus_per_node=8, tp=2, gpu_memory=40 * GB))
    assert report.recommendation.placement.stage == 2   # 21 GB of 40: 80% fits
    assert report.config["tensor_parallel"] == {"autotp_size": 2}
    text = " ".join(report.render().split())
    assert "Tensor parallel T = 2" in text and "being built" not in text
    load_config(report.config, world_size=8)
    # Ψ_T = 3.5B over D = 4: stage 2 needs 21 GB (over 80% of 24), stage 3 15.75 GB
    report = estimate(EstimateRequest(SEVEN_B, gpus_per_node=8, tp=2, gpu_memory=24 * GB))
    assert report.recommendation.placement == Placement(3)
    assert report.config["zero_optimization"]["stage"] == 3
    assert report.config["tensor_parallel"] == {"autotp_size": 2}
    load_config(report.config, world_size=8)


def test_muon_keeps_one_momentum_and_its_recommended_config_loads():
    """Muon's formula rows count one fp32 momentum (4 bytes; the traced step counts its
    AdamW half exactly) and the config it recommends is a Muon config zerotrain accepts."""
    from zerotrain.estimate import BytesPerParam, EstimateRequest, estimate
    assert BytesPerParam.of("bf16", "muon") == BytesPerParam(2, 2, 8, 8)
    assert BytesPerParam.of("fp32", "muon") == BytesPerParam(4, 4, 4, 8)
    report = estimate(EstimateRequest(total_params=10**9, gpus_per_node=8, optimizer="muon",
                                      gpu_memory=80 * 10**9))
    assert "Muon" in report.render()
    assert load_config(report.config, world_size=8).optimizer.type == "Muon"
