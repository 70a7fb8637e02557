"""The Hugging Face Trainer with ``deepspeed=<config with tensor_parallel.autotp_size 2>``
runs on zerotrain through the switch (``import deepspeed`` resolves to zerotrain), as with
DeepSpeed: transformers fills ``train_batch_size`` counting all N ranks, records the split
with ``deepspeed.tp_model_init``, and Accelerate gives the two ranks of each
tensor-parallel group the same batch. A tiny Llama then trains like the plain Trainer on
one process whose batch holds the N/2 data-parallel ranks' samples (fp32, clipping,
accumulation 2, a short last window at the epoch's end), at stages 1, 2 and 3 (the
model built whole, outside ``zero.Init``), and ``save_model`` writes the whole weights.

The ranks are the shared worlds, so the switch is turned on and off around the run
(:func:`_switch`). transformers and Accelerate decide at import whether ``deepspeed``
exists (the base class of the Trainer's DeepSpeed config; the DeepSpeed wrappers that
``accelerate.utils``, ``accelerate.accelerator`` and ``transformers.trainer`` import only
then), and a rank that other tests used has imported them already; a launched script
installs the switch before either is imported and needs none of this.
"""
import pytest
import torch

pytestmark = pytest.mark.slow

VOCAB, SEQ, SAMPLES, MICRO = 64, 12, 56, 4
COMMON = dict(learning_rate=1e-2, weight_decay=0.0, max_grad_norm=0.5, warmup_steps=2,
              gradient_accumulation_steps=2, max_steps=4, logging_steps=1, seed=0,
              report_to=[], disable_tqdm=True, save_strategy="no")


def _model():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _data():
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def _curve(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {key: [h[name] for h in logs] for key, name in
            (("loss", "loss"), ("grad_norm", "grad_norm"), ("lr", "learning_rate"))}


_DEEPSPEED_NAMES = ("DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper",
                    "DeepSpeedSchedulerWrapper", "DummyOptim", "DummyScheduler",
                    "HfDeepSpeedConfig", "get_active_deepspeed_plugin",
                    "map_pytorch_optim_to_deepspeed")


def _switch(on):
    """The switch on (as ``zerotrain launch --as-deepspeed`` sets it up) or off, with what
    transformers and Accelerate decided at import brought in line (module docstring), and
    their process-wide DeepSpeed state cleared either way."""
    import os

    import accelerate.utils
    import accelerate.utils.deepspeed as accelerate_deepspeed
    from accelerate.state import AcceleratorState

    from zerotrain import as_deepspeed
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    if not on:
        as_deepspeed.uninstall()
    else:
        as_deepspeed.install()
        as_deepspeed._accelerate_on_cpu()
        import accelerate.accelerator
        for module in (accelerate.utils, accelerate.accelerator):
            for name in _DEEPSPEED_NAMES:
                if not hasattr(module, name):
                    setattr(module, name, getattr(accelerate_deepspeed, name))
        import transformers.trainer
        transformers.trainer.DeepSpeedSchedulerWrapper = (
            accelerate_deepspeed.DeepSpeedSchedulerWrapper)
    import transformers.integrations.deepspeed as hf_deepspeed
    hf_deepspeed.unset_hf_deepspeed_config()
    if not on:   # install() itself gives the config class DeepSpeed's base (deepspeed_gates)
        from zerotrain.integrations.deepspeed_gates import reload_hf_deepspeed
        reload_hf_deepspeed()   # its config class's base, as deepspeed is now


def _trainer_with_tp(rank, world, root, stage):
    import transformers
    _switch(True)
    try:
        return _train_with_tp(transformers, world, root, stage)
    finally:
        _switch(False)


def _train_with_tp(transformers, world, root, stage):
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": stage, "gather_16bit_weights_on_model_save": True},
              "tensor_parallel": {"autotp_size": 2}}
    args = transformers.TrainingArguments(output_dir=f"{root}/tp{world}",
                                          per_device_train_batch_size=MICRO,
                                          deepspeed=config, **COMMON)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_data())
    trainer.train()
    trainer.save_model(f"{root}/tp{world}/final")   # Accelerate gathers the split weights
    engine = trainer.model_wrapped
    out = {**_curve(trainer), "train_batch_size": engine.train_batch_size(),
           "tp": engine.mp_world_size, "dp": engine.dp_world_size,
           "q": tuple(engine.module.model.layers[0].self_attn.q_proj.weight.shape)}
    engine.destroy()
    return out


def _plain(root, dp):
    import transformers
    args = transformers.TrainingArguments(output_dir=f"{root}/plain{dp}", use_cpu=True,
                                          per_device_train_batch_size=MICRO * dp, **COMMON)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_data())
    trainer.train()
    return _curve(trainer), {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("world,stage", [(2, 1), (4, 2), (4, 3)])
def test_trainer_deepspeed_tensor_parallel_matches_the_plain_trainer(worlds, tmp_path, world,
                                                                     stage):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    dp = world // 2
    reference, weights = _plain(str(tmp_path), dp)
    for rank, res in enumerate(worlds.run(world, _trainer_with_tp, str(tmp_path), stage)):
        assert (res["tp"], res["dp"], res["q"]) == (2, dp, (16, 32)), res
        # DeepSpeed's count: micro x accumulation x all N ranks
        assert res["train_batch_size"] == MICRO * 2 * world, res
        assert len(res["loss"]) == COMMON["max_steps"], res
        for key in ("loss", "grad_norm", "lr"):
            assert res[key] == pytest.approx(reference[key], abs=1e-4), (rank, key, res)
    import transformers
    saved = transformers.LlamaForCausalLM.from_pretrained(f"{tmp_path}/tp{world}/final")
    for name, tensor in saved.named_parameters():   # whole, as trained
        assert tensor.shape == weights[name].shape, name
        assert (tensor - weights[name]).abs().max() < 1e-4, name
