"""An ordinary TRL GRPO script: a tiny GPT-2 and a word-level tokenizer built in memory (no
downloads), 16 fixed prompts, a reward that counts one token in each completion.

Nothing in the training knows of zerotrain: ``--deepspeed ds_config.json`` goes to
``GRPOConfig``. Writes ``{"losses", "generates", "numel"}`` to ``--out`` on rank 0: the logged
losses and, with ``--count_gathers`` (zerotrain only: it reads the engine's comm ledger), for
each generation block on this rank the elements all-gathered around TRL's
``unwrap_model_for_generation`` block and inside ``generate()``. ``--saved DIR``: a folder
holding this same initial model (:func:`save_initial`), from which TRL builds the reference
model when ``--beta`` > 0.
"""
import dataclasses
import gc
import json
import time

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

WORDS = [f"w{i}" for i in range(60)]


@dataclasses.dataclass
class ScriptArguments:
    out: str = ""
    count_gathers: bool = False
    saved: str = ""   # a folder holding this same model (save_initial), for beta > 0


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def reward(completions, **kwargs) -> list[float]:
    """How often ``w7`` appears: any deterministic function of the text will do."""
    return [float(c.split().count("w7")) for c in completions]


def prompts() -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = [" ".join(WORDS[int(i)] for i in torch.randint(0, 60, (4,), generator=g))
            for _ in range(16)]
    return Dataset.from_dict({"prompt": rows})


def build_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=2, bos_token_id=1, eos_token_id=1,
                                      pad_token_id=0))


def save_initial(folder: str) -> None:
    """The initial model, written once by the caller before the ranks start."""
    build_model().save_pretrained(folder)


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, GRPOConfig))
    script_args, args = parser.parse_args_into_dataclasses()
    model = build_model()
    if script_args.saved:   # TRL builds a reference model from the policy's name_or_path
        model.config._name_or_path = script_args.saved
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=prompts(), processing_class=tokenizer())
    generates = _count_gathers(trainer, model) if script_args.count_gathers else []
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if args.process_index == 0 and script_args.out:
        with open(script_args.out, "w") as f:
            json.dump({"losses": losses, "generates": generates, "numel": sum(
                getattr(p, "ds_numel", p.numel()) for p in model.parameters())}, f)
    _end()


def _count_gathers(trainer, model) -> list:
    """For each generation block (TRL's ``unwrap_model_for_generation``): the elements
    all-gathered by zerotrain's comm ledger around the block and inside ``generate()``."""
    import contextlib

    import trl.trainer.grpo_trainer as grpo

    counts: list = []
    unwrap, generate = grpo.unwrap_model_for_generation, model.generate

    def gathered() -> int:
        return trainer.model_wrapped.comm.ledger.elements["all_gather"]

    @contextlib.contextmanager
    def counted_unwrap(*args, **kwargs):
        before = gathered()
        with unwrap(*args, **kwargs) as unwrapped:
            yield unwrapped
        counts[-1]["block"] = gathered() - before

    def counted_generate(*args, **kwargs):
        before = gathered()
        out = generate(*args, **kwargs)
        counts.append({"generate": gathered() - before, "new_tokens":
                       out.shape[1] - kwargs["input_ids"].shape[1]})
        return out

    grpo.unwrap_model_for_generation, model.generate = counted_unwrap, counted_generate
    return counts


def _end() -> None:
    """Let gloo's threads finish before exit (see train_clm.py)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
