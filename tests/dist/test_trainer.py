"""ZeroTrainer: a Hugging Face Trainer script trains under zerotrain by changing its import.

The reference is the plain ``transformers.Trainer`` on one process in the test process
(``use_cpu=True``, the same global batch: 8 per device there, 4 per rank here). The data
has 7 micro-batches per rank with accumulation 2, so every epoch ends with the Trainer's
short last window. Training is fp32, so the curves agree to float rounding.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, SEQ, SAMPLES = 64, 12, 56
COMMON = dict(learning_rate=1e-2, weight_decay=0.0, max_grad_norm=0.5, warmup_steps=2,
              gradient_accumulation_steps=2, max_steps=4, logging_steps=1, seed=0,
              report_to=[], disable_tqdm=True, save_strategy="no")


def _model(kind):
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=2, tie_word_embeddings=True, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=SAMPLES, seed=1):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _curve(trainer, after=0):
    logs = [h for h in trainer.state.log_history if "loss" in h and h["step"] > after]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "lr": [h["learning_rate"] for h in logs]}


def _plain_curve(kind, out):
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=8,
                                          use_cpu=True, **COMMON)
    trainer = transformers.Trainer(model=_model(kind), args=args, train_dataset=_Tokens())
    trainer.train()
    return _curve(trainer)


# Stage 0: no config beyond the stage; 1: a DeepSpeed optimizer section of "auto" values
# (with the Trainer's scheduler: DeepSpeed's schedules run one step behind transformers');
# 2: "auto" batch keys; 3: "auto" bucket sizes, the model built partitioned.
CONFIGS = {
    0: {"zero_optimization": {"stage": 0}},
    1: {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "zero_optimization": {"stage": 1}},
    2: {"train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
    3: {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": 0}},
}


def _stage_grid(rank, world, kind, root):
    from zerotrain.integrations.transformers import (ZeroTrainer, ZeroTrainingArguments,
                                                     zero3_init)
    from zerotrain.zero import GatheredParameters
    out = {}
    for stage, config in CONFIGS.items():
        args = ZeroTrainingArguments(output_dir=f"{root}/{kind}{stage}",
                                     per_device_train_batch_size=4, deepspeed=config, **COMMON)
        with zero3_init(args):
            model = _model(kind)
        params = list(model.parameters())
        partitioned = all(p.numel() == 0 for p in params)
        with GatheredParameters(params):
            norm0 = float(sum(p.detach().double().pow(2).sum() for p in params))
        trainer = ZeroTrainer(model=model, args=args, train_dataset=_Tokens(),
                              eval_dataset=_Tokens(16, seed=2))
        trainer.train()
        memory = trainer.engine.memory_breakdown()
        eval_loss = trainer.evaluate()["eval_loss"]
        with torch.no_grad():
            generated = trainer.model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4,
                                               do_sample=False, pad_token_id=0).tolist()
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        out[stage] = {**_curve(trainer), "memory": memory, "eval_loss": eval_loss,
                      "generated": generated, "numel": numel, "init_norm": norm0,
                      "partitioned": partitioned}
    fresh = {}  # evaluation before any training builds the engine itself
    for stage in (0, 3):
        args = ZeroTrainingArguments(output_dir=f"{root}/{kind}{stage}",
                                     per_device_train_batch_size=4, zerotrain=CONFIGS[stage],
                                     **COMMON)
        with zero3_init(args):
            model = _model(kind)
        trainer = ZeroTrainer(model=model, args=args, eval_dataset=_Tokens(16, seed=2))
        fresh[stage] = trainer.evaluate()["eval_loss"]
    return {"stages": out, "fresh": fresh}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_zero_trainer_matches_plain_trainer_at_every_stage(worlds, tmp_path, kind):
    reference = _plain_curve(kind, str(tmp_path / "plain"))
    results = worlds.run(2, _stage_grid, kind, str(tmp_path))
    grid = results[0]["stages"]
    assert results[0]["fresh"][3] == pytest.approx(results[0]["fresh"][0], abs=1e-5)
    psi = grid[0]["numel"]
    for stage, res in grid.items():
        for key in ("loss", "grad_norm", "lr"):
            assert res[key] == pytest.approx(reference[key], abs=1e-4), (stage, key, res)
        assert res["init_norm"] == pytest.approx(grid[0]["init_norm"], rel=1e-12), stage
        assert res["eval_loss"] == pytest.approx(grid[0]["eval_loss"], abs=1e-5), stage
        assert res["generated"] == grid[0]["generated"], stage
        assert results[1]["stages"][stage]["loss"] == res["loss"], "ranks log the same loss"
    assert grid[3]["partitioned"] and not grid[2]["partitioned"]
    # fp32 Adam, bytes per rank with N = 2 after training (stage 0 steps the parameters
    # themselves; at stages 1-2 a separate fp32 master shard sits with the two moments; at
    # stages 2-3 the gradient shards are freed after the step)
    expect = {0: (4 * psi, 4 * psi, 8 * psi), 1: (4 * psi, 4 * psi, 6 * psi),
              2: (4 * psi, 0, 6 * psi), 3: (2 * psi, 0, 4 * psi)}
    for stage, (params, grads, optim) in expect.items():
        mem = grid[stage]["memory"]
        got = (mem["parameters"], mem["gradients"], mem["optimizer_state"])
        assert got == pytest.approx((params, grads, optim), rel=0.01, abs=64), (stage, got)
    # bytes per parameter at stage 2, fp32, N = 2: 10, plus the zero padding that makes each
    # parameter split evenly (at most N - 1 elements of master and moments per parameter)
    held = sum(grid[2]["memory"][k] for k in ("parameters", "gradients", "optimizer_state"))
    assert held <= 10.001 * psi, held / psi


WARMUP = {"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_type": "linear"}}


def _save_and_resume(rank, world, root):
    from zerotrain.integrations.transformers import (ZeroTrainer, ZeroTrainingArguments,
                                                     from_pretrained, zero3_init)
    from zerotrain.zero import GatheredParameters
    config = {"scheduler": WARMUP,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    run = dict(COMMON, save_strategy="steps", save_steps=2)

    def trainer(seed):
        args = ZeroTrainingArguments(output_dir=f"{root}/run", per_device_train_batch_size=4,
                                     zerotrain=config, **run)
        with zero3_init(args):
            model = _model("gpt2") if seed == 0 else _other_init("gpt2")
        return ZeroTrainer(model=model, args=args, train_dataset=_Tokens())

    full = trainer(0)
    full.train()
    full.save_model(f"{root}/final")
    with GatheredParameters(list(full.model.parameters())):
        trained = {n: p.detach().clone() for n, p in full.model.named_parameters()}
    if rank == 0:
        shutil.rmtree(f"{root}/run/checkpoint-4")  # so that True means checkpoint-2
    torch.distributed.barrier()
    resumed = trainer(1)
    resumed.train(resume_from_checkpoint=True)
    with GatheredParameters(list(resumed.model.parameters())):
        resumed_diff = max((p - trained[n]).abs().max().item()
                           for n, p in resumed.model.named_parameters())
    loaded = from_pretrained(transformers.GPT2LMHeadModel, f"{root}/final", config)
    with GatheredParameters(list(loaded.parameters())):
        loaded_diff = max((p - trained[n]).abs().max().item()
                          for n, p in loaded.named_parameters())
    return {"full": _curve(full), "resumed": _curve(resumed, after=2),
            "resumed_diff": resumed_diff, "loaded_diff": loaded_diff,
            "files": sorted(os.listdir(f"{root}/run/checkpoint-2")),
            "trained": {n: t for n, t in trained.items()} if rank == 0 else None}


def _other_init(kind):
    """Different starting weights (partitioned or not): a resumed run must not use them."""
    from zerotrain.zero import GatheredParameters
    model = _model(kind)
    with GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def _resume_alone(rank, world, root):
    from zerotrain.integrations.transformers import ZeroTrainer, ZeroTrainingArguments
    args = ZeroTrainingArguments(output_dir=f"{root}/run", per_device_train_batch_size=8,
                                 zerotrain={"scheduler": WARMUP, "zero_optimization": {"stage": 2}},
                                 **dict(COMMON, save_strategy="steps", save_steps=2))
    trainer = ZeroTrainer(model=_other_init("gpt2"), args=args, train_dataset=_Tokens())
    trainer.train(resume_from_checkpoint=f"{root}/run/checkpoint-2")
    return _curve(trainer, after=2)


def test_save_model_loads_without_zerotrain_and_training_resumes(worlds, tmp_path):
    root = str(tmp_path)
    res = worlds.run(2, _save_and_resume, root)[0]
    assert res["resumed"]["loss"] == pytest.approx(res["full"]["loss"][2:], abs=1e-6), res
    assert res["resumed_diff"] <= 1e-6 and res["loaded_diff"] == 0.0, res
    assert "latest" in res["files"] and "model.safetensors" not in res["files"], res["files"]
    plain = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/final")
    for name, tensor in plain.named_parameters():
        assert torch.equal(tensor, res["trained"][name]), name
    # the stage-3 checkpoint of 2 ranks resumes on 1 rank at stage 2 (same global batch)
    alone = worlds.run(1, _resume_alone, root)[0]
    assert alone["loss"] == pytest.approx(res["full"]["loss"][2:], abs=1e-4), alone


def test_auto_values_come_from_the_arguments_and_disagreements_name_both(tmp_path):
    from zerotrain.config import load_config
    from zerotrain.errors import ConfigError
    from zerotrain.integrations.transformers import ZeroTrainer, ZeroTrainingArguments
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "bf16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                        "eps": "auto", "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupCosineLR", "params": {
                  "warmup_num_steps": "auto", "total_num_steps": "auto"}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto",
                                    "param_persistence_threshold": "auto"}}
    args = ZeroTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                 gradient_accumulation_steps=3, learning_rate=2e-4,
                                 adam_beta2=0.95, max_grad_norm=0.7, warmup_steps=0.1,
                                 deepspeed=config, report_to=[])
    assert args.zerotrain == config and args.deepspeed is None and args.use_cpu
    filled = ZeroTrainer(model=_model("llama"), args=args).zerotrain_config(100)
    assert (filled["train_batch_size"], filled["train_micro_batch_size_per_gpu"],
            filled["gradient_accumulation_steps"], filled["gradient_clipping"]) == (24, 8, 3, 0.7)
    assert filled["bf16"] == {"enabled": False}
    assert filled["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                             "weight_decay": 0.0}
    assert filled["scheduler"]["params"] == {"warmup_num_steps": 10, "total_num_steps": 100}
    assert filled["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 32 * 32,
                                           "stage3_prefetch_bucket_size": int(0.9 * 32 * 32),
                                           "param_persistence_threshold": 320}
    # transformers' documented ZeRO-3 config is valid for zerotrain once filled
    hf_docs = {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
                        "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
               "bf16": {"enabled": "auto"},
               "optimizer": config["optimizer"],
               "scheduler": {"type": "WarmupDecayLR", "params": {
                   "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                   "total_num_steps": "auto"}},
               "zero_optimization": {
                   "stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
                   "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                   "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                   "stage3_param_persistence_threshold": "auto",
                   "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                   "stage3_gather_16bit_weights_on_model_save": True},
               "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
               "steps_per_print": 2000, "train_batch_size": "auto",
               "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
    args.zerotrain = hf_docs
    filled = ZeroTrainer(model=_model("llama"), args=args).zerotrain_config(100)
    assert load_config(filled, world_size=1).zero_optimization.stage3_prefetch_bucket_size == 921
    bad = ZeroTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                zerotrain={"train_micro_batch_size_per_gpu": 4}, report_to=[])
    with pytest.raises(ConfigError) as err:
        ZeroTrainer(model=_model("llama"), args=bad)
    assert ("train_micro_batch_size_per_gpu=4 in the zerotrain config vs "
            "per_device_train_batch_size=8 in the TrainingArguments") in str(err.value)
    with pytest.raises(ValueError, match="not both"):
        ZeroTrainingArguments(output_dir=str(tmp_path), deepspeed={}, zerotrain={})


@pytest.mark.slow
def test_import_without_transformers_says_what_to_install():
    code = ("import sys; sys.modules['transformers'] = None; import zerotrain\n"
            "try:\n    import zerotrain.integrations.transformers\n"
            "except ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "pip install zerotrain[transformers]" in out, out


def test_plain_trainer_refuses_zero_training_arguments(tmp_path):
    from zerotrain.integrations.transformers import ZeroTrainer, ZeroTrainingArguments

    args = ZeroTrainingArguments(output_dir=str(tmp_path), report_to=[],
                                 deepspeed={"zero_optimization": {"stage": 2}})
    with pytest.raises(TypeError, match="not ZeroTrainer.*without zerotrain"):
        transformers.Trainer(model=_model("gpt2"), args=args, train_dataset=_Tokens())
    ZeroTrainer(model=_model("gpt2"), args=args, train_dataset=_Tokens())  # the right class
    with pytest.raises(TypeError, match="not ZeroTrainer"):   # and still refused after it
        transformers.Trainer(model=_model("gpt2"), args=args, train_dataset=_Tokens())
