"""Tensor parallelism under ZeRO (``tensor_parallel.autotp_size``): tiny Llama- and GPT-2-
style transformers split over T=2 ranks, ZeRO-1/2 over the data-parallel ranks, train like
one process on the global batch (fp32; bf16 tracks fp32), clipping included; checkpoints
reshard across T and the data-parallel size and export whole weights."""
import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 3
MICRO = 2
LR = 1e-2
CLIP = 0.05   # below the gradients' norm, so the clipping (and so the norm) matters


def _model(family):
    import transformers
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


def _batch(step, dp_rank):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, 64, (MICRO, 8), generator=g)


def _config(stage, tp, precision="fp32", **extra):
    import reference as R
    return R.engine_config(stage=stage, clip=CLIP, lr=LR, micro_size=MICRO, bucket=200,
                           precision=precision, tensor_parallel={"autotp_size": tp}, **extra)


def _reference(family, dp, steps=STEPS):
    """One process on the global batch: the mean of the data-parallel ranks' losses."""
    model = _model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)
    norms = []
    for step in range(steps):
        loss = sum(model(input_ids=_batch(step, r), labels=_batch(step, r)).loss
                   for r in range(dp)) / dp
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _full_weights(engine):
    """Every parameter whole (split ones gathered over the tensor-parallel group)."""
    return {n: engine.stage.full_copy(p).float() for n, p in engine.module.named_parameters()}


def _train(rank, family, stage, tp, precision="fp32"):
    import zerotrain
    engine, *_ = zerotrain.initialize(model=_model(family), config=_config(stage, tp, precision))
    dp_rank = engine.get_data_parallel_rank()
    norms = []
    for step in range(STEPS):
        ids = _batch(step, dp_rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
    weights = _full_weights(engine)
    local = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    dims = engine.stage.dimensions()
    engine.destroy()
    return weights, norms, local, dims


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _parity(rank, world):
    tp, dp = 2, world // 2
    out = {}
    for family in ("llama", "gpt2"):
        ref, ref_norms = _reference(family, dp)
        for stage in (1, 2):
            weights, norms, local, dims = _train(rank, family, stage, tp)
            out[(family, stage)] = (_max_diff(weights, ref),
                                    max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
                                    local, dims)
    weights, _, _, _ = _train(rank, "llama", 2, tp, "bf16")
    out["bf16"] = _max_diff(weights, _reference("llama", dp)[0])
    return out


@pytest.mark.parametrize("world", [4, 2])
def test_tp_zero_matches_one_process_on_the_global_batch(worlds, world):
    for rank, out in enumerate(worlds.run(world, _parity)):
        for case in [("llama", 1), ("llama", 2), ("gpt2", 1), ("gpt2", 2)]:
            diff, norm_error, local, dims = out[case]
            assert diff < 1e-5, (world, rank, case, diff)
            assert norm_error < 1e-5, (world, rank, case, norm_error)
            assert dims["tensor_parallel"]["size"] == 2
            assert dims["data_parallel"]["size"] == world // 2
            assert dims["tensor_parallel"]["comm_bytes"]["all_reduce"] > 0
        llama = out[("llama", 1)][2]   # q: 4 heads of 4 -> 2 per rank; kv: 2 heads -> 1
        assert llama["model.layers.0.self_attn.q_proj.weight"] == (8, 16)
        assert llama["model.layers.0.self_attn.k_proj.weight"] == (4, 16)
        assert llama["model.layers.0.self_attn.o_proj.weight"] == (16, 8)
        assert llama["model.embed_tokens.weight"] == (64, 16)
        gpt2 = out[("gpt2", 1)][2]   # Conv1D keeps (in, out): c_attn 3 x 16 -> 3 x 8 columns
        assert gpt2["transformer.h.0.attn.c_attn.weight"] == (16, 24)
        assert gpt2["transformer.h.0.mlp.c_proj.weight"] == (32, 16)
        assert out["bf16"] < 5e-2, (world, rank, out["bf16"])
