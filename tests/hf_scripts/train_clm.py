"""An ordinary Hugging Face causal-LM Trainer script, as ``run_clm.py`` is written.

Nothing here knows of zerotrain: ``--deepspeed ds_config.json`` goes to ``TrainingArguments``.
A tiny GPT-2 (or, with ``--model mixtral``, a tiny Mixtral: a mixture of experts whose
tokens route differently on each rank) is built from its config (no downloads); the data
is a fixed stand-in corpus.
After training it saves the model with ``save_model`` (the caller reloads it).
Writes ``{"losses", "eval_loss", "train_loss"}`` to ``--out`` on rank 0.
"""
import dataclasses
import gc
import json
import time

import torch
from transformers import (AutoModelForCausalLM, GPT2Config, HfArgumentParser, MixtralConfig,
                          Trainer, TrainingArguments, set_seed)


@dataclasses.dataclass
class ScriptArguments:
    out: str = ""
    model: str = "gpt2"


class StandInData(torch.utils.data.Dataset):
    """32 sequences of 16 tokens drawn from a fixed generator: the same on every rank."""

    def __init__(self, n: int = 32, length: int = 16, vocab: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    script_args, args = parser.parse_args_into_dataclasses()
    set_seed(args.seed)
    if script_args.model == "mixtral":
        config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                               num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, num_local_experts=4,
                               num_experts_per_tok=1, max_position_embeddings=32)
    else:
        config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = AutoModelForCausalLM.from_config(config)   # ZeRO-3: built under zero.Init
    trainer = Trainer(model=model, args=args, train_dataset=StandInData(),
                      eval_dataset=StandInData(n=8, seed=1))
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(args.output_dir)
    if args.process_index == 0 and script_args.out:
        with open(script_args.out, "w") as f:
            json.dump({"losses": losses, "eval_loss": eval_loss, "train_loss":
                       result.training_loss, "leaves": sorted(
                           {type(m).__name__ for m in model.modules()
                            if getattr(m, "_z3_leaf", False)})}, f)   # DeepSpeed's flag
    _end()


def _end() -> None:
    """Destroy the process group and let gloo's threads finish before the interpreter exits.

    Plain torch on gloo sometimes aborts at exit otherwise ("terminate called without an
    active exception"): a gloo worker thread releases finished work while Python tears down.
    zerotrain does this itself at exit; the plain run this script also serves does not.
    """
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
