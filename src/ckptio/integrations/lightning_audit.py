"""Lightning feeds the resume audit: ``Trainer(plugins=[CkptioCheckpointIO()])`` and nothing else.

A ``CheckpointIO`` is never given the ``Trainer``; the plugin finds the one that is saving or loading through it on
the call stack (``Trainer.save_checkpoint``, the checkpoint connector's restore: both call it with themselves as
``self`` a few frames up) at its first save or load in ``fit``, and appends :class:`AuditFeed` to its callbacks.
The feed gives :class:`~.framework_audit.FrameworkAudit` (the run's record in the checkpoints' folder), at the end
of each training batch in the steps the audit records or compares: the loss ``training_step`` returned (Lightning's
``outputs``), the first optimizer's learning rate and, when the module logs one, ``grad_norm``. Steps are
``trainer.global_step``. Lightning keeps no RNG state in its checkpoints: a divergence names it among the causes.
Rank 0 only (Lightning saves there); local folders only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

import pytorch_lightning as pl

from .. import _dist
from .framework_audit import FrameworkAudit

__all__ = ["AuditFeed", "saved", "loaded"]


class AuditFeed(pl.Callback):
    """The end of each training batch, to ``audit`` (in the steps it records or compares), and the end of ``fit``."""

    def __init__(self, audit: FrameworkAudit) -> None:
        self.audit = audit

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any, **kwargs: Any) -> None:
        step = trainer.global_step
        if not self.audit.wants(step):
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is None:
            return  # manual optimization returning nothing: no loss to audit
        metrics: dict[str, Any] = {"loss": loss}
        if trainer.optimizers:
            metrics["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        norm = trainer.callback_metrics.get("grad_norm")
        if norm is not None:
            metrics["grad_norm"] = norm
        self.audit.tick(step, metrics)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.audit.end()

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self.audit.end(clean=False)


def _trainer_on_stack(depth: int = 16) -> pl.Trainer | None:
    """The ``Trainer`` whose call reached the plugin: ``self`` (or ``self.trainer``) of a caller's frame."""
    frame: Any = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        try:
            owner = getattr(obj, "trainer", None)
        except Exception:  # a property that raises (a module not attached to a trainer): not the one
            owner = None
        for candidate in (obj, owner):
            if isinstance(candidate, pl.Trainer):
                return candidate
        frame = frame.f_back
    return None


def _audit(io: Any, path: Any) -> tuple[FrameworkAudit, Any] | None:
    """The audit of the folder ``path`` is in, fed from the fitting trainer found on the stack; ``None`` elsewhere
    (another rank, an object store, a load outside ``fit``)."""
    if _dist.rank() != 0 or "://" in str(path):
        return None
    trainer: Any = _trainer_on_stack()
    if trainer is None or trainer.state.fn != "fit":
        return None
    folder = Path(path).absolute().parent
    audit = getattr(io, "_audit", None)
    if audit is not None and audit.folder != folder and not audit.ended:
        return None  # a save elsewhere than the run's folder (the first one saved or loaded in this fit)
    if audit is None or audit.ended:
        if audit is not None:
            io.numbers.listeners.remove(audit.committed)
        audit = io._audit = FrameworkAudit(folder)
        io.numbers.listeners.append(audit.committed)
    if not any(isinstance(cb, AuditFeed) and cb.audit is audit for cb in trainer.callbacks):
        trainer.callbacks.append(AuditFeed(audit))
    return audit, trainer


def saved(io: Any, checkpoint: dict[str, Any], path: Any) -> None:
    """``io`` saves ``checkpoint`` at ``path``: the steps after its global step are recorded."""
    found = _audit(io, path)
    step = checkpoint.get("global_step")
    if found is not None and type(step) is int:
        found[0].saved(step)


def loaded(io: Any, checkpoint: dict[str, Any], path: Any) -> None:
    """``fit`` resumes from ``checkpoint`` (read from ``path``): the steps after its global step are compared."""
    found = _audit(io, path)
    step = checkpoint.get("global_step")
    if found is not None and type(step) is int:
        found[0].restored(step, causes=["rng"])
