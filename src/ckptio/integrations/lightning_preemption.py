"""Saving on preemption under Lightning: ``Trainer(callbacks=[CkptioPreemption(on_preemption="exit")])``.

Lightning handles ``SIGTERM`` itself (its ``_SignalConnector``, installed when ``fit`` starts): it notes the signal,
passes it on to the processes its own launcher started, and ends ``fit`` at the end of the current batch with
``SIGTERMException`` (a ``SystemExit``, status 0) without saving; with its SLURM environment and ``auto_requeue`` it
also saves an ``hpc_ckpt_N.ckpt`` and requeues the job on the requeue signal (``SIGUSR1``). Its ``SIGTERM`` handler
is collective (Lightning 2.6 broadcasts from rank 0 inside it): run on one rank alone, it leaves the ranks'
collectives out of step (a hang, or an abort). This callback saves too: when training starts it puts ckptio's
handler on ``preemption_signals``, which only notes the signal; at the end of each training batch every rank learns
whether any rank got a signal (one all-reduce of one integer), and if one did, every rank saves that step through
Lightning's own ``trainer.save_checkpoint`` as ``last.ckpt`` in the ``ModelCheckpoint``'s folder (or ``dirpath``),
where ``fit(ckpt_path="last")`` finds it, and waits until it is committed (``CkptioCheckpointIO(async_save=True)``
too). Then every rank calls the handler the signal had before ckptio's (Lightning's, and what it chains to), together,
whichever rank got the signal: Lightning hears it on every rank and its collective is matched. Then ``"exit"`` raises
``SystemExit(0)``; ``"return"`` sets ``trainer.should_stop`` so that ``fit`` returns (for a signal Lightning does
not end ``fit`` on itself, such as ``SIGUSR1`` outside SLURM: on ``SIGTERM`` Lightning ends ``fit`` with
``SIGTERMException`` at the end of the batch, after the save, which the callback says when made). When training
ends, the signals get back the handlers they had.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, Sequence

import pytorch_lightning as pl

from ..errors import ConfigError
from ..config_checks import parse_signal
from .framework_preemption import FrameworkPreemption, exit_after_save

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
        self.preemption = FrameworkPreemption(on_preemption, preemption_signals, "CkptioPreemption",
                                              defer_previous=True)  # Lightning's handler is collective
        if on_preemption == "return" and signal.SIGTERM in {parse_signal(s) for s in preemption_signals}:
            logging.getLogger("ckptio").warning(
                "CkptioPreemption(on_preemption='return'): Lightning ends fit on SIGTERM itself (SIGTERMException, a "
                "SystemExit with status 0), so after ckptio's save on SIGTERM the process exits instead of fit "
                "returning; 'return' hands control back on the other signals (such as SIGUSR1 outside SLURM)")
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
        self.preemption.call_previous(signum)  # Lightning's own, on every rank at once: its broadcast is matched
        if self.preemption.mode == "exit":
            exit_after_save()
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
