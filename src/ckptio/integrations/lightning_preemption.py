"""Saving on preemption under Lightning: ``Trainer(callbacks=[CkptioPreemption(on_preemption="exit")])``.

Lightning handles ``SIGTERM`` itself (its ``_SignalConnector``, installed when ``fit`` starts): it notes the signal,
passes it on to the processes its own launcher started, and ends ``fit`` at the end of the current batch with
``SIGTERMException`` (a ``SystemExit``, status 0) without saving; with its SLURM environment and ``auto_requeue`` it
also saves an ``hpc_ckpt_N.ckpt`` and requeues the job on the requeue signal (``SIGUSR1``). This callback saves too:
when training starts it puts ckptio's handler on ``preemption_signals``, which chains to Lightning's (so Lightning's
still runs, and still stops the run); at the end of each training batch every rank learns whether any rank got a
signal (one all-reduce of one integer), and if one did, every rank saves that step through Lightning's own
``trainer.save_checkpoint`` as ``last.ckpt`` in the ``ModelCheckpoint``'s folder (or ``dirpath``), where
``fit(ckpt_path="last")`` finds it, and waits until it is committed (``CkptioCheckpointIO(async_save=True)`` too).
Then ``"exit"`` raises ``SystemExit(0)``; ``"return"`` sets ``trainer.should_stop`` so that ``fit`` returns (for a
signal Lightning does not end ``fit`` on itself, such as ``SIGUSR1`` outside SLURM). When training ends, the signals
get back the handlers they had.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import pytorch_lightning as pl

from ..errors import ConfigError
from .framework_preemption import FrameworkPreemption

__all__ = ["CkptioPreemption"]


class CkptioPreemption(pl.Callback):
    """Save the step in which a preemption signal came, on every rank, as ``last.ckpt`` (see the module's
    documentation). ``on_preemption`` (``"exit"`` or ``"return"``) and ``preemption_signals``: as
    :class:`~ckptio.CheckpointConfig`'s. ``dirpath``: where ``last.ckpt`` goes (default: the ``ModelCheckpoint``'s
    folder)."""

    def __init__(self, on_preemption: str = "exit", preemption_signals: Sequence[Any] = ("SIGTERM",),
                 dirpath: str | os.PathLike | None = None) -> None:
        if on_preemption is None:
            raise ConfigError("CkptioPreemption: on_preemption must be 'exit' or 'return' (leave the callback out to "
                              "save nothing on preemption)")
        self.preemption = FrameworkPreemption(on_preemption, preemption_signals, "CkptioPreemption")
        self.dirpath = dirpath
        self.path: str | None = None
        """The checkpoint saved on preemption (``None`` before)."""

    @property
    def preempted(self) -> int | None:
        """The signal on which the callback saved and stopped the run; ``None`` before."""
        return self.preemption.preempted

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.preemption.install()  # after Lightning's own (registered as fit starts): ours calls it

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        signum = self.preemption.due()
        if not signum:
            return
        self.path = os.path.join(self._folder(trainer), "last.ckpt")
        trainer.save_checkpoint(self.path)
        wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
        if callable(wait):  # CkptioCheckpointIO(async_save=True): committed before the process may go
            wait()
        trainer.strategy.barrier("ckptio-preemption")
        self.preemption.saved(signum, f"step {trainer.global_step} ({self.path})")
        if self.preemption.mode == "exit":
            raise SystemExit(0)
        trainer.should_stop = True

    def _folder(self, trainer: pl.Trainer) -> str:
        if self.dirpath is not None:
            return os.fspath(self.dirpath)
        folder = getattr(trainer.checkpoint_callback, "dirpath", None)
        if folder is None:
            raise ConfigError("CkptioPreemption: the Trainer has no ModelCheckpoint to take the folder from; pass "
                              "CkptioPreemption(dirpath=...)")
        return str(folder)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.preemption.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self.preemption.close()

    def teardown(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self.preemption.close()
