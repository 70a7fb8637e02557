"""The Hugging Face Trainer with ``parallelism_config=ParallelismConfig(sp_backend=
"deepspeed", sp_size=2)`` and a DeepSpeed config runs on zerotrain through the switch, as
on DeepSpeed: Accelerate registers Ulysses attention, passes its mpu to ``initialize`` and
wraps the train loader in ``UlyssesSPDataLoaderAdapter``; the Trainer gathers the shards'
losses (``deepspeed_sp_compute_loss``). A tiny Llama then trains at SP=2 on 2 ranks like
the plain Trainer on one process (SP=1) over the same sequences in the same order, at
stage 3, with accumulation and a warm-up schedule (losses within 1e-5, weights 1e-4). The gradient is S times the
one-process one, as on DeepSpeed (each rank's loss is the whole sequence's, and ZeRO
divides the sum by the data-parallel ranks only), so the logged norm is twice the
reference's and clipping is off: AdamW's step does not see the factor.
"""
import pytest
import torch

from test_tensor_parallel_trainer import _curve, _switch

pytestmark = pytest.mark.slow

VOCAB, SEQ, SAMPLES, MICRO = 64, 12, 16, 2
COMMON = dict(learning_rate=1e-2, weight_decay=0.0, max_grad_norm=0.0, warmup_steps=2,
              gradient_accumulation_steps=2, max_steps=4, logging_steps=1, seed=0,
              report_to=[], disable_tqdm=True, save_strategy="no",
              train_sampling_strategy="sequential")


def _model():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _data():
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row, "position_ids": torch.arange(SEQ)} for row in ids]


def _trainer_with_sp(rank, world, root, stage):
    import transformers
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from zerotrain.comm import groups, parallel_state_sp
    from zerotrain.sequence.registration import unregister
    _switch(True)
    try:
        pc = ParallelismConfig(sp_backend="deepspeed", sp_size=world,
                               sp_handler=DeepSpeedSequenceParallelConfig(
                                   sp_seq_length_is_variable=True,
                                   sp_attn_implementation="sdpa"))
        config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                  "zero_optimization": {"stage": stage}}
        args = transformers.TrainingArguments(output_dir=f"{root}/sp{stage}",
                                              per_device_train_batch_size=MICRO,
                                              deepspeed=config, parallelism_config=pc,
                                              **COMMON)
        trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_data())
        trainer.train()
        engine = trainer.model_wrapped
        out = {**_curve(trainer), "sp": engine.sequence_parallel_size,
               "weights": {n: p.detach().clone() for n, p in
                           _full(engine).items()}}
        engine.destroy()
        return out
    finally:
        unregister("sdpa")
        parallel_state_sp.release()
        groups.mpu = None
        _switch(False)


def _full(engine):
    from zerotrain.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}


def _plain(root):
    import transformers
    args = transformers.TrainingArguments(output_dir=f"{root}/plain", use_cpu=True,
                                          per_device_train_batch_size=MICRO, **COMMON)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_data())
    trainer.train()
    return _curve(trainer), {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_trainer_parallelism_config_sp2_matches_sp1(worlds, tmp_path):
    pytest.importorskip("accelerate")
    stage = 3
    reference, weights = _plain(str(tmp_path))
    for rank, res in enumerate(worlds.run(2, _trainer_with_sp, str(tmp_path), stage)):
        assert res["sp"] == 2, res
        assert len(res["loss"]) == COMMON["max_steps"], res
        assert res["loss"] == pytest.approx(reference["loss"], abs=1e-5), (rank, res["loss"])
        assert res["lr"] == pytest.approx(reference["lr"], abs=1e-9), (rank, res["lr"])
        assert res["grad_norm"] == pytest.approx([2 * g for g in reference["grad_norm"]],
                                                 rel=1e-4), (rank, res["grad_norm"])
        for name, tensor in res["weights"].items():   # AdamW's eps meets the 2x gradient
            assert (tensor - weights[name]).abs().max() < 1e-4, name
