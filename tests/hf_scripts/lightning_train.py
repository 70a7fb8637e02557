"""A PyTorch Lightning script with DeepSpeed's strategy, as a user writes it, on CPU ranks.

Nothing here knows of zerotrain. ``--strategy deepspeed_stage_3`` trains with Lightning's
``DeepSpeedStrategy(stage=3)``, saves with ``trainer.save_checkpoint`` (a sharded folder)
and, on rank 0, converts it with Lightning's own ``convert_zero_checkpoint_to_fp32_state_dict``;
``--strategy ddp`` trains the same with DDP and saves the weights. Either way ``--out``
gets the final fp32 weights (``torch.save``).

Lightning's DeepSpeed strategy refuses any accelerator but CUDA (its own check), and
CPU devices have no index to match the local rank; ``CPUDeepSpeedStrategy`` skips those two
checks so the strategy runs on CPU (docs/lightning.md).
"""
import argparse
import os

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DeepSpeedStrategy
from lightning_fabric.utilities.seed import reset_seed


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy without its CUDA-only checks."""

    def setup_environment(self) -> None:
        super(DeepSpeedStrategy, self).setup_environment()   # DDPStrategy's: no CUDA check

    def setup_distributed(self) -> None:
        reset_seed()              # as DeepSpeedStrategy's, less the device-index check
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    y = torch.randn(32, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "deepspeed_stage_3"], required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)   # DeepSpeed's launcher passes it
    args = parser.parse_args()
    pl.seed_everything(0, workers=True)
    model = Regression()
    strategy = "ddp" if args.strategy == "ddp" else CPUDeepSpeedStrategy(stage=3)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                         strategy=strategy, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=args.root)
    trainer.fit(model, _data())
    if args.strategy == "ddp":
        if trainer.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
        return
    folder = os.path.join(args.root, "final.ckpt")
    trainer.save_checkpoint(folder)
    if trainer.global_rank == 0:
        from pytorch_lightning.utilities.deepspeed import (
            convert_zero_checkpoint_to_fp32_state_dict)
        converted = os.path.join(args.root, "converted.pt")
        convert_zero_checkpoint_to_fp32_state_dict(folder, converted)
        state = torch.load(converted, weights_only=False)["state_dict"]
        torch.save(state, args.out)


if __name__ == "__main__":
    main()
