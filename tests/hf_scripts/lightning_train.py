"""A PyTorch Lightning script with DeepSpeed's strategy, as a user writes it, on CPU ranks.

Nothing here knows of zerotrain. ``deepspeed_stage_3`` trains with Lightning's
``DeepSpeedStrategy(stage=3)``, saves with ``trainer.save_checkpoint`` (a sharded folder)
and, on rank 0, converts it with Lightning's own ``convert_zero_checkpoint_to_fp32_state_dict``;
``ddp`` trains the same with DDP. ``--strategies ddp,deepspeed_stage_3`` runs both in turn in
one process (DDP never imports deepspeed, so the switch does not touch it) and ``--out``
gets ``{strategy: final fp32 weights}`` (``torch.save``).

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


def _fit(strategy_name: str, root: str) -> dict:
    """Train with ``strategy_name``; the final fp32 weights (for DeepSpeed, converted from
    the saved checkpoint by Lightning's function on rank 0; {} on the other ranks)."""
    pl.seed_everything(0, workers=True)
    model = Regression()
    strategy = "ddp" if strategy_name == "ddp" else CPUDeepSpeedStrategy(stage=3)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                         strategy=strategy, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root)
    trainer.fit(model, _data())
    if strategy_name == "ddp":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    folder = os.path.join(root, "final.ckpt")
    trainer.save_checkpoint(folder)
    if trainer.global_rank != 0:
        return {}
    from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    converted = os.path.join(root, "converted.pt")
    convert_zero_checkpoint_to_fp32_state_dict(folder, converted)
    return torch.load(converted, weights_only=False)["state_dict"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="ddp,deepspeed_stage_3",
                        help="comma-separated, run in turn: ddp, deepspeed_stage_3")
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)   # DeepSpeed's launcher passes it
    args = parser.parse_args()
    results = {name: _fit(name, os.path.join(args.root, name))
               for name in args.strategies.split(",")}
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
