"""generate() at stage 3 when ranks stop at different lengths: every rank keeps gathering
until all are done (transformers' ``synced_gpus``), so each gets its own sequence, equal to
an unsharded model's, and the collectives that follow still pair up. Before, the rank that
finished first left the loop and its peer's remaining gathers paired with its next calls.
Also TRL's generation block (its own ``remove_hooks``/``add_hooks`` through
``optimizer.parameter_offload``): one gather of the model, none while generating."""
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


def _trl_generation_block(rank, world):
    """TRL's ZeRO-3 generation block, its own functions: gather everything, remove the
    hooks through ``optimizer.parameter_offload``, generate, re-add, release."""
    import torch
    import transformers
    from trl.models.utils import add_hooks, remove_hooks

    import zerotrain
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    engine, *_ = zerotrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "comms_timeout": 60,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    offload = engine.optimizer.parameter_offload
    hooks = len(offload.forward_hooks)
    ledger = engine.comm.ledger
    prompt = torch.tensor([[1, 2, 3]])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    out = {"numel": sum(p.ds_numel for p in model.parameters())}
    with torch.no_grad():
        before = ledger.elements["all_gather"]
        with zerotrain.zero.GatheredParameters(engine.parameters()):
            remove_hooks(engine)
            out["hooks out"] = (len(offload.forward_hooks), len(offload.backward_hooks))
            inside = ledger.elements["all_gather"]
            out["tokens"] = model.generate(prompt, **kwargs).tolist()
            out["in generate"] = ledger.elements["all_gather"] - inside
            add_hooks(engine)
        out["block"] = ledger.elements["all_gather"] - before
        out["plain"] = plain.generate(prompt, **kwargs).tolist()
    out["hooks"] = (hooks, len(offload.forward_hooks))
    before = ledger.elements["all_gather"]
    loss = engine(prompt, labels=prompt).loss   # the hooks gather again, once each
    engine.backward(loss)
    engine.step()
    out["train gathered"] = ledger.elements["all_gather"] - before
    engine.destroy()
    return out


def test_trl_generation_block_gathers_once_and_puts_the_hooks_back(worlds):
    pytest.importorskip("trl")
    for rank, res in enumerate(worlds.run(2, _trl_generation_block)):
        assert res["tokens"] == res["plain"], rank
        assert res["hooks out"] == (0, 0)
        assert res["in generate"] == 0 and res["block"] == res["numel"], res
        assert res["hooks"][0] > 0 and res["hooks"][1] == res["hooks"][0]
        assert res["train gathered"] >= res["numel"]   # forward (and backward) gather again
