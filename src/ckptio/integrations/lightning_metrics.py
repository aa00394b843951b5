"""Lightning: each checkpoint's numbers in the run's loggers, under ``ckpt/`` (``Trainer(callbacks=[CkptioMetrics()],
plugins=[CkptioCheckpointIO()])``).

``ModelCheckpoint`` saves at the end of a batch or of validation, after the other callbacks' hooks; a save's numbers
go to every logger of the trainer (``trainer.loggers``, each ``log_metrics`` at the save's step) at the end of the
next training batch (a background save's once it is committed), and at the end of ``fit``. Not through
``LightningModule.log_dict``: a value a callback logs there on one step is sent again with every later step of the
epoch (measured with Lightning's ``CSVLogger``), which would draw one save as many.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.callbacks import Callback

__all__ = ["CkptioMetrics"]


class CkptioMetrics(Callback):
    """Logs ``ckpt/blocked_s`` (what the training loop waited), ``ckpt/total_s`` (the whole save), ``ckpt/bytes``,
    ``ckpt/files`` and ``ckpt/step`` of each checkpoint a :class:`~ckptio.lightning.CkptioCheckpointIO` wrote."""

    @staticmethod
    def _numbers(trainer: Any) -> Any:
        return getattr(trainer.strategy.checkpoint_io, "numbers", None)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        """The saves committed since the last batch, to the loggers."""
        numbers = self._numbers(trainer)
        if numbers is not None:
            self._to_loggers(trainer, numbers.drain())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The last saves (a background one is waited for) go to the loggers."""
        numbers = self._numbers(trainer)
        if numbers is not None:
            trainer.strategy.checkpoint_io.wait()
            self._to_loggers(trainer, numbers.drain())

    @staticmethod
    def _to_loggers(trainer: Any, drained: list[dict[str, float]]) -> None:
        for metrics in drained:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=int(metrics.get("ckpt/step", trainer.global_step)))
        for logger in trainer.loggers if drained else ():
            logger.save()
