"""Ulysses sequence parallelism (``zerotrain.sequence``) under ZeRO, against one process on
the whole sequences.

Each data-parallel group g of S ranks trains on its own stream of sequences B[g][0], B[g][1]...
(variable lengths, some not a multiple of S: the adapter pads them); the ranks of the group
draw them through ``UlyssesSPDataLoaderAdapter`` and ``register_with_transformers`` routes
attention through the head exchange. Each rank's loss is the summed token loss of its shard
over the tokens of the whole sequence, so the S shards add up to the sequence's mean loss;
ZeRO sums over every rank and divides by the N/S data-parallel ranks, as DeepSpeed does.
The reference is one process: the mean over g of the mean token loss of B[g][i], the same
optimizer, clipping and accumulation. Losses and every weight agree within 1e-5 (fp32)
after several steps, at stages 1-3, for a tiny Llama (2 key-value heads: at S=4 they are
repeated) and a tiny Qwen2, with sdpa and eager attention; bf16 within bf16's precision.
"""
import pytest
import torch

pytestmark = pytest.mark.slow

VOCAB = 64
LENGTHS = (12, 9, 16, 7)   # per micro-step; 9 and 7 are padded to a multiple of S


def model(family: str, attn: str = "sdpa", heads: int = 4, kv: int = 2):
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=48,
                  num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv,
                  max_position_embeddings=64, attn_implementation=attn)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))


def sequence(g: int, i: int) -> dict:
    """Batch i of data-parallel group g: one row of LENGTHS[i % 4] tokens."""
    n = LENGTHS[i % len(LENGTHS)]
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(100 * g + i))
    labels = ids.clone()
    labels[0, :2] = -100   # a prompt that is not learned
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(n)[None]}


def _token_loss_sum(logits, shift_labels):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             shift_labels.reshape(-1), ignore_index=-100,
                                             reduction="sum")


def _valid(batch) -> int:
    return int((batch["labels"][0, 1:] != -100).sum())


def _config(stage, ga, clip, precision):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ga,
           "gradient_clipping": clip, "zero_optimization": {"stage": stage},
           "steps_per_print": 10 ** 9}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def reference(family, attn, dp, steps, ga, clip):
    """One process: losses per step and the final weights."""
    net = model(family, attn)
    opt = _optimizer(net.parameters())
    losses = []
    for s in range(steps):
        total = 0.0
        for m in range(ga):
            for g in range(dp):
                b = sequence(g, s * ga + m)
                out = net(input_ids=b["input_ids"], position_ids=b["position_ids"])
                shift = torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[:, 1:]
                loss = _token_loss_sum(out.logits, shift) / _valid(b)
                (loss / (dp * ga)).backward()
                total += float(loss.detach()) / (dp * ga)
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


class _Draws:
    """Rank (g, r)'s own loader: B[g][r], B[g][S + r], ... (Note "one batch, S shards")."""

    def __init__(self, g, r, sp, n):
        self.items = [sequence(g, j * sp + r) for j in range(n)]

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)


def train_sp(rank, world, family, attn, sp, stage, steps, ga, clip, precision="fp32"):
    """The same run on S ranks per sequence; the losses (each micro-step's shards summed over
    the world, divided as the reference) and the full fp32 weights."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.sequence.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from zerotrain.utils import safe_get_full_fp32_param
    net = model(family, attn)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=net, core_attn_implementation=attn, sequence_parallel_size=sp,
        micro_batch_size=1, seq_length_is_variable=True)
    engine, _, _, _ = zerotrain.initialize(model=net, optimizer=_optimizer(net.parameters()),
                                           config=_config(stage, ga, clip, precision), mpu=mpu)
    dp = world // sp
    g, r = rank // sp, rank % sp
    loader = UlyssesSPDataLoaderAdapter(
        _Draws(g, r, sp, -(-steps * ga // sp)), sp_rank=mpu.get_sequence_parallel_rank(),
        sp_group=mpu.get_sequence_parallel_group(),
        sp_world_size=mpu.get_sequence_parallel_world_size(), device=engine.device)
    batches = iter(loader)
    losses = []
    for s in range(steps):
        total = torch.zeros(())
        for m in range(ga):
            b = next(batches)
            out = engine(input_ids=b["input_ids"], position_ids=b["position_ids"])
            valid = _valid(sequence(g, s * ga + m))
            loss = _token_loss_sum(out.logits, b["shift_labels"]) / valid
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / (dp * ga)
        dist.all_reduce(total)
        losses.append(float(total))
    weights = {n: safe_get_full_fp32_param(p).detach().clone()
               for n, p in engine.module.named_parameters()}
    return losses, weights


def release():
    """Forget the sequence groups and the attention wrapper (the worlds are shared)."""
    from zerotrain.comm import groups, parallel_state_sp
    from zerotrain.sequence.registration import unregister
    for name in ("sdpa", "eager"):
        unregister(name)
    parallel_state_sp.release()
    groups.mpu = None


def _grid(rank, world, cases):
    """Every case on these ranks; each rank returns its verdicts (max differences)."""
    out = []
    for case in cases:
        family, attn, sp, stage, steps, ga, clip, precision = case
        ref_losses, ref_weights = reference(family, attn, world // sp, steps, ga, clip)
        try:
            losses, weights = train_sp(rank, world, family, attn, sp, stage, steps, ga, clip,
                                       precision)
        finally:
            release()
        dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
        dw = max(float((weights[n] - ref_weights[n]).abs().max()) for n in ref_weights)
        out.append((case, dl, dw, losses))
    return out


def _check(results, tol):
    for case, dl, dw, losses in results[0]:
        print(f"{case}: loss {dl:.1e}, weights {dw:.1e}")
        assert len(losses) == case[4]
        assert dl < tol and dw < tol, f"{case}: loss differs by {dl:.2e}, weights by {dw:.2e}"


def test_sp2_matches_one_process_at_stages_1_to_3(worlds):
    """S=2 on 2 ranks: Llama and Qwen2, sdpa and eager, stages 1-3, accumulation and
    clipping, variable lengths."""
    cases = [("llama", "sdpa", 2, 1, 3, 2, 1.0, "fp32"),
             ("qwen2", "eager", 2, 2, 3, 1, 0.05, "fp32"),
             ("llama", "eager", 2, 3, 3, 2, 0.0, "fp32"),
             ("qwen2", "sdpa", 2, 3, 2, 1, 1.0, "fp32")]
    _check(worlds.run(2, _grid, cases), 1e-5)


def test_sp4_and_sp2_dp2_match_one_process(worlds):
    """World 4: S=4 (the 2 key-value heads repeated up to 4) and S=2 x DP=2, stages 1-3."""
    cases = [("llama", "sdpa", 4, 3, 3, 1, 1.0, "fp32"),
             ("qwen2", "eager", 4, 1, 2, 2, 0.0, "fp32"),
             ("llama", "sdpa", 2, 2, 3, 2, 1.0, "fp32"),
             ("qwen2", "sdpa", 2, 3, 3, 1, 0.05, "fp32")]
    _check(worlds.run(4, _grid, cases), 1e-5)


def test_sp2_bf16_follows_one_process(worlds):
    """bf16 at S=2, stage 3: within bf16's precision of the fp32 reference."""
    results = worlds.run(2, _grid, [("llama", "sdpa", 2, 3, 2, 1, 1.0, "bf16")])
    for case, dl, dw, losses in results[0]:
        assert dl < 5e-2 and dw < 5e-2, (case, dl, dw)


def _errors(rank, world):
    """Each refusal as (type name, message) on this rank."""
    import types

    import zerotrain
    from zerotrain.comm import groups
    from zerotrain.sequence.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    out = {}

    def caught(key, fn):
        try:
            fn()
        except Exception as exc:   # noqa: BLE001 - the test reads what each rank raised
            out[key] = (type(exc).__name__, str(exc))
        finally:
            release()

    register = UlyssesSPAttentionHF.register_with_transformers
    caught("heads", lambda: register(model_name_or_path=model("llama", heads=3, kv=3),
                                     core_attn_implementation="sdpa", sequence_parallel_size=2,
                                     micro_batch_size=1))
    flex = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=None))
    caught("flex", lambda: register(model_name_or_path=flex,
                                    core_attn_implementation="flex_attention",
                                    sequence_parallel_size=2, micro_batch_size=1))
    caught("mismatch", lambda: register(model_name_or_path=model("llama", "eager"),
                                        core_attn_implementation="sdpa",
                                        sequence_parallel_size=2, micro_batch_size=1))
    caught("mpu", lambda: zerotrain.initialize(model=model("llama"), mpu=object(),
                                               config=_config(1, 1, 0.0, "fp32")))

    def different_lengths():
        net = model("llama")
        mpu = register(model_name_or_path=net, core_attn_implementation="sdpa",
                       sequence_parallel_size=2, micro_batch_size=1)
        engine, *_ = zerotrain.initialize(model=net, optimizer=_optimizer(net.parameters()),
                                          config=_config(1, 1, 0.0, "fp32"), mpu=mpu)
        n = 6 + 2 * rank   # each rank its own batch, not its shard of one
        engine(input_ids=torch.zeros(1, n, dtype=torch.long), position_ids=torch.arange(n)[None])
    caught("ranks", different_lengths)

    def fixed_length():   # registered for 16 tokens (8 a rank), fed 12
        net = model("llama")
        mpu = register(model_name_or_path=net, core_attn_implementation="sdpa",
                       sequence_parallel_size=2, micro_batch_size=1, seq_length=16,
                       seq_length_is_variable=False)
        engine, *_ = zerotrain.initialize(model=net, optimizer=_optimizer(net.parameters()),
                                          config=_config(1, 1, 0.0, "fp32"), mpu=mpu)
        engine(input_ids=torch.zeros(1, 6, dtype=torch.long),
               position_ids=torch.arange(6)[None] + 6 * rank)
    caught("fixed", fixed_length)

    def no_positions():
        from zerotrain.comm import parallel_state_sp
        parallel_state_sp.initialize_sequence_parallel(2)
        b = sequence(0, 0)
        del b["position_ids"]
        next(iter(UlyssesSPDataLoaderAdapter([b], sp_rank=rank, sp_world_size=2, device="cpu",
                                             sp_group=parallel_state_sp.
                                             get_sequence_parallel_group())))
    caught("positions", no_positions)

    def from_config():   # sequence_parallel_size alone builds the mesh, as DeepSpeed's key
        engine, *_ = zerotrain.initialize(model=model("llama"), config={
            **_config(1, 1, 0.0, "fp32"), "sequence_parallel_size": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        answers = (engine.sequence_parallel_size, groups._get_sequence_parallel_world_size(),
                   groups._get_sequence_parallel_rank(), groups._get_data_parallel_group(),
                   groups._get_sequence_data_parallel_world_size(), engine.train_batch_size())
        raise RuntimeError(repr(answers))
    caught("config", from_config)
    caught("no sp", groups._get_sequence_parallel_group)
    return out


def test_unsupported_inputs_are_refused_by_name_on_every_rank(worlds):
    """Heads not divisible by S, an attention the wrapper cannot run, a model whose
    attention differs from the one registered, a Megatron-style mpu, the ranks of one group
    fed different batches (RankMismatchError on every rank, not a hang), a length other
    than the registered fixed one, a batch without positions; and ``sequence_parallel_size`` in the config alone builds the groups."""
    for rank, out in enumerate(worlds.run(2, _errors)):
        assert out["heads"] == ("ValueError",
                                "Attention head count 3 is not divisible by SP size 2"), out
        assert out["flex"][0] == "ValueError" and "flex_attention" in out["flex"][1], out
        assert out["mismatch"][0] == "ValueError" and "'eager'" in out["mismatch"][1], out
        assert out["mpu"][0] == "ConfigError" and out["mpu"][1].startswith("mpu:"), out
        assert out["ranks"][0] == "RankMismatchError", out
        assert "rank 0: (1, 6, 4, 2, 8)" in out["ranks"][1], out   # (bs, local seq, heads...)
        assert "rank 1: (1, 8, 4, 2, 8)" in out["ranks"][1], out
        assert out["positions"][0] == "ValueError" and "position_ids" in out["positions"][1]
        assert out["fixed"][0] == "ValueError", out
        assert out["fixed"][1].startswith("local sequence length 6 is not the registered 8"), out
        assert out["config"] == ("RuntimeError", repr((2, 2, rank, None, 2, 1))), out
        assert out["no sp"][0] == "KeyError", out


def _checkpoint_across_sizes(rank, world, root):
    """Save at S=2 x DP=2 (stage 3), load at S=4 (stage 3) and without sequence parallelism
    (S=1, DP=4, stage 2): the full weights and Adam's moments as saved, and a step runs."""
    import zerotrain
    from zerotrain.sequence.ulysses_sp import UlyssesSPAttentionHF
    from zerotrain.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    def engine_at(sp, stage):
        net = model("llama")
        mpu = (UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=net, core_attn_implementation="sdpa", sequence_parallel_size=sp,
            micro_batch_size=1) if sp > 1 else None)
        engine, *_ = zerotrain.initialize(model=net, optimizer=_optimizer(net.parameters()),
                                          config=_config(stage, 1, 1.0, "fp32"), mpu=mpu)
        return engine

    def state(engine):
        return {n: (safe_get_full_fp32_param(p).clone(),
                    safe_get_full_optimizer_state(p, "exp_avg_sq").clone())
                for n, p in engine.module.named_parameters()}

    def step(engine, sp):
        b = sequence(rank // sp, 0)
        n = b["input_ids"].shape[1] // sp * sp
        cut = slice(rank % sp * n // sp, (rank % sp + 1) * n // sp)
        out = engine(input_ids=b["input_ids"][:, cut], position_ids=b["position_ids"][:, cut])
        engine.backward(out.logits.float().square().mean())
        engine.step()

    try:
        engine = engine_at(2, 3)
        for _ in range(2):
            step(engine, 2)
        saved = state(engine)
        engine.save_checkpoint(root, tag="sp2")
        engine.destroy()
    finally:
        release()
    diffs = {}
    for sp, stage in ((4, 3), (1, 2)):
        try:
            engine = engine_at(sp, stage)
            engine.load_checkpoint(root, tag="sp2")
            loaded = state(engine)
            diffs[sp] = max(max(float((loaded[n][i] - saved[n][i]).abs().max()) for i in (0, 1))
                            for n in saved)
            step(engine, sp)
            engine.destroy()
        finally:
            release()
    return diffs


def test_checkpoint_saved_under_sp_loads_at_other_sp_and_dp_sizes(worlds, tmp_path):
    """Sequence parallelism splits no parameter: a checkpoint is the same files at any S."""
    for diffs in worlds.run(4, _checkpoint_across_sizes, str(tmp_path)):
        assert diffs == {4: 0.0, 1: 0.0}, diffs
