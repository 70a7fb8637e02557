"""Stage 3 on real model code: zero.Init, GatheredParameters, tied and shared parameters,
modules called twice, external parameters, changing execution order, inference, and
Hugging Face models built from a config."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import reference as R

ZERO3 = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 200,
         "stage3_max_reuse_distance": 0}


class NanoStyle(nn.Module):
    """Re-initialises its children after construction (as nanoGPT does) and ties a head."""

    def __init__(self, vocab=37, width=24, depth=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.shared = nn.Linear(width, width)        # called twice per forward
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight           # tied
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.05)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets, skip_block=False):
        h = self.tok(idx)
        for i, block in enumerate(self.blocks):
            if skip_block and i == 0:                # data-dependent path
                continue
            h = torch.tanh(block(h))
        h = self.shared(self.shared(h))
        # uses a parameter of another module (registered as external at stage 3)
        h = h + F.linear(h, self.mix.weight) * 0.1 + self.mix(h)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _tokens(step, rank, vocab=37):
    g = torch.Generator().manual_seed(100 * step + rank)
    idx = torch.randint(0, vocab, (2, 9), generator=g)
    return idx, torch.roll(idx, 1, dims=1)


def _config(stage):
    config = R.engine_config(stage=stage, lr=3e-3)
    config["zero_optimization"].update(ZERO3)
    return config


def _real_code(rank, world):
    import zerotrain
    out = {}
    torch.manual_seed(0)
    plain = NanoStyle()
    torch.manual_seed(0)
    with zerotrain.zero.Init():
        partitioned = NanoStyle()
    out["no_full_param_held"] = all(p.numel() == 0 for p in partitioned.parameters())
    with zerotrain.zero.GatheredParameters(list(partitioned.parameters())):
        out["init_equal"] = all(torch.equal(a, b) for a, b in
                                zip(plain.parameters(), partitioned.parameters()))
    params = {}
    for stage, model in ((0, plain), (3, partitioned)):
        if stage == 3:
            zerotrain.zero.register_external_parameter(model, model.mix.weight)
        engine, *_ = zerotrain.initialize(model=model, config=_config(stage))
        losses = []
        for step in range(4):
            loss = engine(*_tokens(step, rank), skip_block=(step == 2))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.eval()
        with torch.no_grad():
            losses.append(engine(*_tokens(9, rank)).item())
        with zerotrain.zero.GatheredParameters(list(model.parameters())):
            params[stage] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[f"losses{stage}"] = losses
    out["param_diff"] = R.max_diff(params[0], params[3])
    out["tied"] = partitioned.head.weight is partitioned.tok.weight
    return out


def test_stage3_runs_real_model_code_like_stage0(worlds):
    for res in worlds.run(2, _real_code):
        assert res["no_full_param_held"] and res["init_equal"] and res["tied"], res
        assert res["losses0"] == pytest.approx(res["losses3"], abs=1e-6), res
        assert res["param_diff"] <= 1e-6, res


def _unregistered_external_and_late_module(rank, world):
    """``mix.weight`` read by the parent without ``register_external_parameter``, then a
    module attached after initialize (Notes in ``stages/param_watch.py``)."""
    import logging

    import zerotrain
    from zerotrain.stages.param_watch import TrackedParameters, ZeROOrderedDict
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("zerotrain.stages.param_watch")
    log.addHandler(handler)
    out = {}
    params = {}
    try:
        for stage in (0, 3):
            torch.manual_seed(0)
            model = NanoStyle()
            engine, *_ = zerotrain.initialize(model=model, config=_config(stage))
            out[f"container{stage}"] = type(model.mix._parameters).__name__
            for step in range(2):
                loss = engine(*_tokens(step, rank))
                engine.backward(loss)
                engine.step()
            out[f"warned_before{stage}"] = list(seen)
            model.late = nn.Linear(24, 24)             # not used by forward: still named
            model.mix.extra = nn.Parameter(torch.zeros(3))
            engine(*_tokens(3, rank))
            engine(*_tokens(4, rank))                  # once per parameter
            out[f"warned{stage}"], seen[:] = list(seen), []
            del model.late, model.mix.extra
            with zerotrain.zero.GatheredParameters(list(model.parameters())):
                params[stage] = {n: p.detach().clone() for n, p in model.named_parameters()}
            engine.destroy()
            out[f"bound_after_close{stage}"] = model.mix._parameters._watch is not None
            out[f"is_tracked{stage}"] = isinstance(model.mix._parameters, TrackedParameters)
        out["zero3_dict"] = isinstance(model.mix._parameters, ZeROOrderedDict)
    finally:
        log.removeHandler(handler)
    out["param_diff"] = R.max_diff(params[0], params[3])
    return out


def test_unregistered_external_parameter_and_late_module(worlds):
    """Stage 3 gathers a parameter the parent reads directly (it failed with a size
    mismatch), trains it as stage 0 does; a module or parameter added after initialize is
    named once, at every stage, and nothing is named before."""
    for rank, res in enumerate(worlds.run(2, _unregistered_external_and_late_module)):
        assert res["param_diff"] <= 1e-6, res
        assert res["container0"] == "TrackedParameters", res
        assert res["container3"] == "ZeROOrderedDict" and res["zero3_dict"], res
        for stage in (0, 3):
            assert res[f"warned_before{stage}"] == [], res
            assert len(res[f"warned{stage}"]) == 1, res
            assert "mix.extra (3,), late.weight (24, 24), late.bias (24,)" in res[
                f"warned{stage}"][0], res
            assert not res[f"bound_after_close{stage}"] and res[f"is_tracked{stage}"], res


def _modifier(rank, world):
    import zerotrain
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=_config(3))
    weight = model.hidden.weight
    with zerotrain.zero.GatheredParameters([weight], modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                weight.fill_(1.5)
    with zerotrain.zero.GatheredParameters([weight]):
        seen = weight.detach().clone()
    master = weight.ds_master
    return {"all": bool((seen == 1.5).all()), "shape": tuple(seen.shape),
            "master": bool((master[: min(master.numel(), 377 - rank * master.numel())] == 1.5).all()),
            "after_exit": weight.numel()}


def test_gathered_parameters_writes_modifier_rank_changes_into_every_shard(worlds):
    for res in worlds.run(2, _modifier):
        assert res == {"all": True, "shape": (29, 13), "master": True, "after_exit": 0}


def _hf(rank, world, kind):
    import transformers
    import zerotrain
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=2, tie_word_embeddings=True)
        build = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32)
        build = transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    result = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = build(cfg)
        model.config.use_cache = False
        engine, *_ = zerotrain.initialize(model=model, config=_config(stage))
        losses = []
        for step in range(3):
            ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step * 7 + rank))
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.eval()
        with torch.no_grad():
            prompt = torch.tensor([[1, 2, 3]])
            result[f"gen{stage}"] = engine.module.generate(
                prompt, max_new_tokens=5, do_sample=False, use_cache=False,
                pad_token_id=0).tolist()
        result[f"losses{stage}"] = losses
    return result


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models_train_at_stage3_like_stage0(worlds, kind):
    pytest.importorskip("transformers")
    for res in worlds.run(2, _hf, kind):
        assert res["losses3"] == pytest.approx(res["losses0"], abs=1e-4), res
        assert res["gen3"] == res["gen0"], res


class Deep(nn.Module):
    def __init__(self, width=16, depth=6):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.pow(2).mean()


def _peak_live(rank, world, knobs):
    import zerotrain
    torch.manual_seed(0)
    model = Deep()
    config = R.engine_config(stage=3, overlap=True)
    config["zero_optimization"].update(stage3_param_persistence_threshold=0, **knobs)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):  # the first pass records the order; later ones prefetch
        engine.backward(engine(x))
        engine.step()
    live_after = sum(u.numel for u in engine.stage.units if u.full.untyped_storage().nbytes())
    return {"peak": engine.stage.scheduler.peak_live_numel, "live_after": live_after,
            "block": 16 * 16 + 16}


def test_gathered_parameters_stay_within_max_live_plus_prefetch(worlds):
    block = 16 * 16 + 16
    tight = worlds.run(2, _peak_live, {"stage3_prefetch_bucket_size": 1,
                                       "stage3_max_live_parameters": 0,
                                       "stage3_max_reuse_distance": 0})[0]
    assert tight["peak"] == block and tight["live_after"] == 0, tight  # one block at a time
    ahead = worlds.run(2, _peak_live, {"stage3_prefetch_bucket_size": 2 * block,
                                       "stage3_max_live_parameters": 3 * block,
                                       "stage3_max_reuse_distance": 0})[0]
    # the block in use plus prefetched ones, never above max_live (3 blocks) + the one needed
    assert 2 * block <= ahead["peak"] <= 4 * block and ahead["live_after"] == 0, ahead


def _save16(rank, world, root):
    import transformers
    import zerotrain
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    config = _config(3)
    config["bf16"] = {"enabled": True, "auto_cast": True}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    try:
        engine.save_16bit_model(root)
        refused = None
    except zerotrain.ConfigError as exc:
        refused = exc.path
    engine.config = engine.config.model_copy(update={"zero_optimization": engine.config
                                             .zero_optimization.model_copy(update={
                                                 "stage3_gather_16bit_weights_on_model_save": True})})
    engine.save_16bit_model(root)
    engine.save_16bit_model(root + "/bin", "pytorch_model.bin")
    if rank == 0:
        model.config.save_pretrained(root)
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"refused": refused, "expected": expected}


def test_save_16bit_model_writes_full_weights_that_from_pretrained_loads(worlds, tmp_path):
    transformers = pytest.importorskip("transformers")
    res = worlds.run(2, _save16, str(tmp_path))[0]
    assert res["refused"] == "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    got = dict(loaded.named_parameters())
    assert set(res["expected"]) <= set(got)
    for name, value in res["expected"].items():
        assert torch.equal(got[name], value), name
    # DeepSpeed's file name: a torch.save file that plain torch loads, tied names included
    state = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(str(tmp_path)))
    plain.to(torch.bfloat16).load_state_dict(state)
    for name, value in res["expected"].items():
        assert torch.equal(plain.get_parameter(name), value), name


def _gathered(engine, state: str) -> int:
    """Elements of the units in ``state`` whose full buffer holds bytes."""
    return sum(u.numel for u in engine.stage.units
               if u.state.value == state and u.full.untyped_storage().nbytes())


def _no_grad_forward_releases(rank, world):
    import zerotrain
    torch.manual_seed(0)
    model = Deep()
    config = R.engine_config(stage=3)
    config["zero_optimization"].update(stage3_max_reuse_distance=10 ** 9)  # keep when possible
    engine, *_ = zerotrain.initialize(model=model, config=config)
    x = torch.randn(4, 16)
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    engine.eval()
    with torch.no_grad():
        engine(x)
    after_eval = _gathered(engine, "gathered")
    in_flight = _gathered(engine, "gathering")   # nothing prefetched for a backward to come
    engine.train()
    engine(x)  # a forward with grad but no backward, then a normal step
    engine.backward(engine(x))
    engine.step()
    after_step = sum(u.numel for u in engine.stage.units if u.full.untyped_storage().nbytes())
    return after_eval, in_flight, after_step


def test_forwards_without_backward_leave_nothing_gathered(worlds):
    for after_eval, in_flight, after_step in worlds.run(2, _no_grad_forward_releases):
        assert (after_eval, in_flight, after_step) == (0, 0, 0)


def _state_dict_warning(rank, world, root):
    import logging
    import zerotrain
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zerotrain.stages.zero3.stage").addHandler(handler)
    try:
        model = R.make_model()
        engine, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=3))
        R.train_engine(engine, steps=1, rank=rank, ga=1)
        engine.save_checkpoint(root)                      # zerotrain's own state_dict calls
        model.state_dict(keep_vars=True)
        with zerotrain.zero.GatheredParameters(list(model.parameters())):
            gathered = model.state_dict()
        quiet = len(records)
        empty = model.state_dict()
        model.state_dict()
        return {"quiet": quiet, "after": [r.getMessage() for r in records],
                "gathered": tuple(gathered["hidden.weight"].shape),
                "empty": tuple(empty["hidden.weight"].shape)}
    finally:
        logging.getLogger("zerotrain.stages.zero3.stage").removeHandler(handler)


def test_state_dict_of_a_partitioned_model_warns_once_that_it_holds_no_weights(worlds, tmp_path):
    for res in worlds.run(2, _state_dict_warning, str(tmp_path)):
        assert res["quiet"] == 0, res
        assert res["gathered"] == (29, 13) and res["empty"] == (0,)
        assert len(res["after"]) == 1, res
        assert "partitioned parameters" in res["after"][0], res
        assert "save_16bit_model" in res["after"][0], res
