"""A tiny LightningModule and the run helpers the Lightning plugin tests share (importable by spawned ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    """Two linear layers, AdamW and a step-wise LambdaLR: every piece of state Lightning checkpoints moves."""

    def __init__(self, width: int = 16, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(n: int = 32, batch: int = 4, width: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, width, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=batch, shuffle=False)


def trainer(root: Path | str, max_epochs: int, plugins: list | None = None, **checkpoint: Any) -> pl.Trainer:
    callback = pl.callbacks.ModelCheckpoint(dirpath=str(root), **checkpoint)
    return pl.Trainer(max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", devices=1, callbacks=[callback], plugins=plugins or [],
                      deterministic=True)


def state(module: Tiny, tr: pl.Trainer) -> dict[str, torch.Tensor]:
    """Weights and every optimizer moment, by name, for bitwise comparison."""
    out = {f"w/{k}": v.detach().clone() for k, v in module.state_dict().items()}
    opt = tr.optimizers[0]
    for i, st in enumerate(opt.state.values()):
        out.update({f"o/{i}/{k}": v.detach().clone() for k, v in st.items()})
    out["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    return out


def fit(root: Path | str, epochs: int, plugins: list | None = None, ckpt_path: str | None = None,
        **checkpoint: Any) -> dict[str, torch.Tensor]:
    """A seeded fit of ``Tiny`` checkpointing into ``root`` (a folder or ``s3://``) every epoch, all kept unless
    ``checkpoint`` says otherwise; its final :func:`state`."""
    torch.manual_seed(0)
    module = Tiny()
    checkpoint.setdefault("every_n_epochs", 1)
    checkpoint.setdefault("save_top_k", -1)
    tr = trainer(root, epochs, plugins, **checkpoint)
    tr.fit(module, loader(), ckpt_path=ckpt_path)
    return state(module, tr)


def same(a: dict, b: dict, what: str) -> None:
    """Two states hold the same names, dtypes and bits."""
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


class Evaluated(Tiny):
    """``Tiny`` with validation, test and predict steps (what ``ckpt_path="best"`` runs are for)."""

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: Any, idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Any, idx: int) -> torch.Tensor:
        return self.net(batch[0])


class TinyData(pl.LightningDataModule):
    """The :func:`loader` data as a ``LightningDataModule`` with hyper-parameters (checkpointed by Lightning)."""

    def __init__(self, n: int = 32, batch: int = 4, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _loader(self) -> DataLoader:
        return loader(self.hparams.n, self.hparams.batch, self.hparams.width)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()
