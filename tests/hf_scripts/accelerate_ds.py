"""An ordinary Accelerate training loop with Accelerate's DeepSpeed plugin (the config in
code, an optimizer from the config through ``DummyOptim``, ``accelerator.backward``,
``get_state_dict``). ``--plain``: the same loop without DeepSpeed (torch's AdamW, DDP).
Writes the gathered losses and the final weights' sums to ``--out`` on the main process.

    script.py --stage 2|3 --out result.json [--plain]
"""
import argparse
import gc
import json
import time

import torch
from accelerate import Accelerator, DeepSpeedPlugin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if args.plain:
        accelerator = Accelerator(cpu=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": args.stage,
                                        "stage3_gather_16bit_weights_on_model_save": True}}
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        from accelerate.utils import DummyOptim   # exported where DeepSpeed is available
        optimizer = DummyOptim(model.parameters())
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g),
                                          torch.randn(32, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "processes": accelerator.num_processes,
                       "weights": {k: v.float().sum().item() for k, v in state.items()}}, f)
    if torch.distributed.is_initialized():   # plain torch on gloo can abort at exit otherwise:
        torch.distributed.destroy_process_group()   # let its threads finish first
    gc.collect()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
