"""A Lightning run checkpointed by ckptio: the only change to a plain Lightning script is the ``plugins`` line.

    python examples/lightning/train.py --dir /tmp/lit --epochs 2     # trains, checkpoints every epoch
    python examples/lightning/train.py --dir /tmp/lit --epochs 4     # resumes from last.ckpt, trains on

Each checkpoint (``epoch=1-step=16.ckpt``, ``last.ckpt``) is a ckptio folder: safetensors weights, the optimizer
moments, Lightning's loop and callback state, and a manifest of checksums written last. After ``fit``,
``Regressor.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)`` loads the best one as usual.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckptio.lightning import CkptioCheckpointIO


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="lightning-checkpoints")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--background", action="store_true", help="save in the background (async_save=True)")
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)
    trainer = pl.Trainer(
        max_epochs=args.epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.dir, monitor="train_loss", save_top_k=2, save_last=True)],
        plugins=[CkptioCheckpointIO(async_save=args.background)],   # <- the one line ckptio adds
    )
    trainer.fit(Regressor(), data, ckpt_path="last")  # resumes when last.ckpt is there, starts fresh otherwise
    print(f"trained to step {trainer.global_step}; checkpoints in {args.dir}")
    # as in any Lightning script: the best model (read from its ckptio folder, every checksum verified)
    best = Regressor.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    print(f"best model: {trainer.checkpoint_callback.best_model_path} (width {best.hparams.width})")


if __name__ == "__main__":
    main()
