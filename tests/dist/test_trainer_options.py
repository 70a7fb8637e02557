"""ZeroTrainer at stage 3 with gradient checkpointing (``model.gradient_checkpointing_enable()``)
and with the optimizer and parameters offloaded to the host: the same losses and weights
as the plain stage-3 Trainer run (fp32, 2 ranks, accumulation 2, clipping)."""
import pytest

pytest.importorskip("transformers")


def _run(rank, world, root):
    import torch
    import transformers
    from zerotrain.integrations.transformers import (ZeroTrainer, ZeroTrainingArguments,
                                                     zero3_init)
    from zerotrain.zero import GatheredParameters
    ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    offload = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    out = {}
    for name, extra, checkpointing in (("plain", {}, False), ("checkpointing", {}, True),
                                       ("offload", offload, False)):
        args = ZeroTrainingArguments(
            output_dir=f"{root}/{name}", per_device_train_batch_size=4, max_steps=3,
            gradient_accumulation_steps=2, learning_rate=1e-2, max_grad_norm=0.5,
            logging_steps=1, report_to=[], disable_tqdm=True, save_strategy="no", seed=0,
            deepspeed={"zero_optimization": {"stage": 3, **extra}})
        with zero3_init(args):
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(config)
        if checkpointing:
            model.gradient_checkpointing_enable()
        trainer = ZeroTrainer(model=model, args=args, train_dataset=data)
        trainer.train()
        with GatheredParameters(list(model.parameters())):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[name] = ([h["loss"] for h in trainer.state.log_history if "loss" in h], weights)
        trainer.engine.destroy()
    return out


def test_stage3_trainer_with_checkpointing_and_offload_matches_plain(worlds, tmp_path):
    for res in worlds.run(2, _run, str(tmp_path)):
        losses, weights = res["plain"]
        assert len(losses) == 3
        for name in ("checkpointing", "offload"):
            other_losses, other = res[name]
            assert other_losses == losses, (name, other_losses, losses)
            diff = max((other[k] - weights[k]).abs().max().item() for k in weights)
            assert diff == 0.0, (name, diff)
