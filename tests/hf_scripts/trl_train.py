"""TRL's trainers as a user runs them: SFT (optionally with a peft LoRA adapter) and DPO.

Nothing here knows of zerotrain: ``--deepspeed ds_config.json`` goes to TRL's config (a
``TrainingArguments``). The model is given as a folder, so TRL loads it with
``from_pretrained`` (DPO loads its reference model the same way); under a ZeRO-3 config both
go through transformers' ``zero.Init`` path. The data is a fixed stand-in corpus of words
from the folder's tokenizer. ``--runs dpo,sft_lora`` trains each in turn in the same process; writes ``{run: {"losses",
"grad_norms"}}`` to ``--out`` on rank 0.

``python trl_train.py --make_model DIR`` writes the tiny Llama and its tokenizer first.
"""
import argparse
import gc
import json
import os
import random
import time

import torch

WORDS = [f"w{i}" for i in range(48)]


def make_model(folder: str) -> None:
    """A tiny Llama (random weights, seed 0) and a word-level tokenizer over ``WORDS``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(special + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _train(run: str, args: argparse.Namespace) -> dict:
    """One trainer, as a user script builds it; its logged losses and gradient norms."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    rng = random.Random(0)
    common = dict(output_dir=f"{args.output_dir}/{run}", per_device_train_batch_size=2,
                  gradient_accumulation_steps=1, max_steps=args.max_steps, logging_steps=1,
                  learning_rate=1e-2, bf16=False, report_to="none", save_strategy="no",
                  seed=42, deepspeed=args.deepspeed, use_cpu=args.deepspeed is None,
                  model_init_kwargs={"dtype": torch.float32})
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    peft_config = None
    if run.endswith("_lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    if run.startswith("sft"):
        from trl import SFTConfig, SFTTrainer

        data = Dataset.from_dict({"text": [_sentence(rng, 10) for _ in range(16)]})
        trainer = SFTTrainer(model=args.model, args=SFTConfig(max_length=16, **common),
                             train_dataset=data, processing_class=tokenizer,
                             peft_config=peft_config)
    elif run.startswith("grpo"):
        from trl import GRPOConfig, GRPOTrainer

        def reward(completions, **kwargs):   # more distinct words: higher reward
            return [float(len(set(c.split()))) for c in completions]

        data = Dataset.from_dict({"prompt": [_sentence(rng, 4) for _ in range(16)]})
        config = GRPOConfig(num_generations=2, max_completion_length=4,
                            ds3_gather_for_generation=False,
                            beta=0.1 if run == "grpo_beta" else 0.0, **common)
        trainer = GRPOTrainer(model=args.model, args=config, reward_funcs=reward,
                              train_dataset=data, processing_class=tokenizer,
                              peft_config=peft_config)
    else:
        from trl import DPOConfig, DPOTrainer

        data = Dataset.from_dict({"prompt": [_sentence(rng, 4) for _ in range(16)],
                                  "chosen": [" " + _sentence(rng, 3) for _ in range(16)],
                                  "rejected": [" " + _sentence(rng, 3) for _ in range(16)]})
        trainer = DPOTrainer(model=args.model, args=DPOConfig(max_length=16, **common),
                             train_dataset=data, processing_class=tokenizer,
                             peft_config=peft_config)
    trainer.train()
    history = trainer.state.log_history
    return {"losses": [h["loss"] for h in history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--make_model", default="")
    parser.add_argument("--model", default="")
    parser.add_argument("--runs", default="sft",
                        help="comma-separated, in order: sft, sft_lora, dpo, grpo, "
                             "grpo_beta (a reference model)")
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--out", default="")
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=-1)   # DeepSpeed's launcher passes it
    args = parser.parse_args()
    if args.make_model:
        make_model(args.make_model)
        return

    results = {run: _train(run, args) for run in args.runs.split(",")}
    if int(os.environ.get("RANK", "0")) == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    if torch.distributed.is_initialized():   # as train_clm.py's _end: gloo's threads at exit
        torch.distributed.destroy_process_group()
    gc.collect()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
