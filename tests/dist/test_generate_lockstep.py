"""generate() at stage 3 when ranks stop at different lengths: every rank keeps gathering
until all are done (transformers' ``synced_gpus``), so each gets its own sequence, equal to
an unsharded model's, and the collectives that follow still pair up. Before, the rank that
finished first left the loop and its peer's remaining gathers paired with its next calls."""
import pytest

pytest.importorskip("transformers")


def _generate(rank, world):
    import torch
    import transformers
    import zerotrain
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    engine, *_ = zerotrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "comms_timeout": 60,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    engine.eval()
    prompt = torch.tensor([[1, 2, 3]])
    out = {}
    with torch.no_grad():
        for name, new in (("uneven", 2 + 5 * rank), ("even", 4)):
            kwargs = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
            out[name] = (model.generate(prompt, **kwargs).tolist(),
                         plain.generate(prompt, **kwargs).tolist())
    engine.destroy()
    out["flag left"] = getattr(model, "_is_fsdp_managed_module", False)
    return out


def test_generate_with_uneven_lengths_keeps_ranks_in_lockstep(worlds):
    for rank, res in enumerate(worlds.run(2, _generate)):
        for name in ("uneven", "even"):
            sharded, plain = res[name]
            assert sharded == plain, (rank, name, sharded, plain)
        assert len(res["uneven"][0][0]) == 3 + 2 + 5 * rank
        assert res["flag left"] is False   # destroy() hands back a plain module
