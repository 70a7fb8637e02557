"""The stand-in for ``hf-internal-testing/tiny-random-LlamaForCausalLM`` that Accelerate's
ALST script loads (no hub here): a tiny Llama saved with a small word-level tokenizer under
that relative path, and the script's own run on one process on the whole sequences (its
data, its optimizer), as the reference its sequence-parallel losses must equal.
"""
from __future__ import annotations

import os

import torch

NAME = "hf-internal-testing/tiny-random-LlamaForCausalLM"


def build(root: str) -> str:
    """Save the model (fp32, seed 0) and tokenizer under ``root/NAME``; returns the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    folder = os.path.join(root, NAME)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(253)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, max_position_embeddings=256,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    return folder


def reference_losses(root: str) -> list[float]:
    """The script's loop on one process over the whole sequences (fp32)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, NAME))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    samples, seqlen = 4, 32
    input_ids = torch.arange(1, seqlen * samples + 1).view(-1, seqlen) + 100
    position_ids = torch.arange(seqlen * samples).view(-1, seqlen)
    losses = []
    for i in range(samples):
        optimizer.zero_grad()
        ids, pos = input_ids[i][None], position_ids[i][None]
        shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        out = model(input_ids=ids, position_ids=pos)
        loss = model.loss_function(logits=out.logits, labels=None, shift_labels=shift,
                                   vocab_size=model.config.vocab_size)
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
    return losses
