"""The run's record and the resume audit for the framework integrations (Lightning, the Hugging Face Trainer,
accelerate): the same :class:`~ckptio.goodput.record.RunRecord` and :class:`~ckptio.goodput.audit.ResumeAudit` the
manager keeps, fed from what the framework already computes, with no line of the user's.

:class:`FrameworkAudit` keeps ``.ckptio_record.json`` in the integration's checkpoint folder (a ``start`` when it is
made, each committed save, each restore, ``end`` at a clean end of training, and the audit's ``metrics`` and
``audit`` events) and is fed by the integration: :meth:`~FrameworkAudit.tick` with the step's loss, grad norm and
lr, :meth:`~FrameworkAudit.saved` when it saves, :meth:`~FrameworkAudit.restored` when the framework resumes.
:class:`BackwardSteps` counts a loop's optimizer steps where accelerate sees them (each ``backward`` that syncs the
gradients ends one). Rank 0 records; nothing here is a collective, and a step outside the audit's windows costs
one comparison (:meth:`FrameworkAudit.wants`): its loss is not read off the device.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable

from .. import _dist
from .._log import get_logger
from ..goodput.audit import ResumeAudit
from ..goodput.record import RunRecord

__all__ = ["FrameworkAudit", "BackwardSteps", "AUDIT_STEPS"]

log = get_logger()
"""The manager's logger: rank 0's INFO lines (the audit's verdict) reach the terminal unless logging is configured."""

AUDIT_STEPS = 3
"""The steps recorded after each save (``CheckpointConfig.audit_steps``' default)."""


class FrameworkAudit:
    """The record of the run whose checkpoints are in ``folder`` (a local path or ``s3://…``), kept by rank 0 (on
    the other ranks every method does nothing). ``steps``: how many steps after each save are recorded (0: none);
    ``tolerance``: as ``CheckpointConfig.audit_tolerance``."""

    def __init__(self, folder: Any, *, steps: int = AUDIT_STEPS, tolerance: float = 0.0) -> None:
        from ..goodput import process_age_s
        from ..storage import open_storage

        self.folder = folder
        self.record = RunRecord(open_storage(folder), writer=True, log=log) if _dist.rank() == 0 else None
        self.audit = ResumeAudit(steps, tolerance, self.record, self.emit, log, None)
        self._last: int | None = None
        self._opening: int | None = None
        self._save_steps: dict[int, int] = {}
        self.ended = False
        self.emit("start", begin=False, ranks=_dist.world_size(), age_s=round(process_age_s(), 3))

    def emit(self, kind: str, *, lazy: bool = False, begin: bool | None = None, **values: Any) -> None:
        """One event into the record (written once the run saved or restored, as the manager's)."""
        if self.record is not None:
            if kind in ("save", "restore") if begin is None else begin:
                self.record.begin()
            self.record.add(kind, lazy=lazy, time=round(time.time(), 3), **values)

    # --------------------------------------------------------------------------------------------- the loop
    def wants(self, step: int) -> bool:
        """Whether the metrics of ``step`` are recorded or compared: read them (off the device) only then."""
        return self.audit.wants(step) or (self._opening is not None and self.audit.on and self._opening < step)

    def tick(self, step: int, metrics: dict[str, Any] | None) -> None:
        """The loop ended ``step`` with ``metrics`` (``loss``, ``grad_norm``, ``lr``: numbers or one-element tensors;
        repeated calls for one step count once)."""
        if self.record is None or step == self._last:
            return
        self._last = step
        if self._opening is not None and self._opening < step:
            self._open()
        self.audit.tick(step, metrics)
        if self._opening is not None and self._opening <= step:
            self._open()
        self.record.progress(step)

    def _open(self) -> None:
        assert self._opening is not None
        self.audit.saved(self._opening)
        self._opening = None

    # --------------------------------------------------------------------------------------------- events
    def saved(self, step: int, key: int | None = None) -> None:
        """The integration saves ``step`` (on the training thread): the steps after it are recorded, from its tick on
        (a tick of ``step`` itself, before or after this call, still counts in the window it was in). ``key``: the
        step its save event names, when the integration counts saves otherwise (accelerate's iteration)."""
        if self.record is None:
            return
        self._opening = step
        self._save_steps[step if key is None else key] = step
        while len(self._save_steps) > 16:  # the saves not yet committed: one or two in flight
            del self._save_steps[next(iter(self._save_steps))]

    def committed(self, event: dict[str, Any]) -> None:
        """A listener of the integration's :class:`~.save_numbers.SaveNumbers`: each committed save into the record
        (possibly on a background writer's thread: the record takes its own lock)."""
        if self.record is None:
            return
        values = {k: v for k, v in event.items() if k not in ("kind", "time")}
        values["step"] = self._save_steps.get(event.get("step", -1), event.get("step", 0))
        self.emit("save", ranks=_dist.world_size(), **values)

    def restored(self, step: int, *, causes: list[str] | None = None, saved_ranks: int | None = None,
                 restore_s: float = 0.0) -> None:
        """The framework resumed from the checkpoint of ``step``: a ``restore`` event, and the steps after it are
        compared with what the run that stopped recorded. ``causes``: the states the framework did not resume
        (names of :data:`~ckptio.goodput.audit.CAUSES`); ``saved_ranks``: the ranks the checkpoint was saved on."""
        if self.record is None:
            return
        from ..goodput import process_age_s

        self._last, self._opening = None, None
        newest = self.record.newest_step()
        values: dict[str, Any] = {"steps_lost": max(0, newest - step)} if newest is not None else {}
        self.emit("restore", step=step, tier="durable", restore_s=round(restore_s, 6),
                  startup_s=round(process_age_s(), 3), **values)
        causes = list(causes or [])
        if saved_ranks and saved_ranks != _dist.world_size() and "ranks" not in causes:
            causes.append("ranks")
        self.audit.restored(SimpleNamespace(step=step), causes=causes)

    def flush(self) -> None:
        """The record on disk holds every event added so far (the integration's wait: what the record's thread was
        asked to write, written)."""
        if self.record is not None:
            self.record.flush()

    def end(self, clean: bool = True) -> None:
        """Training ended: the verdict on the steps compared so far, and ``end`` (a clean end) or the held events
        written (an error: the process is a failure in the record)."""
        if self.record is None or self.ended:
            return
        self.ended = True
        self.audit.finish()
        if clean:
            self.emit("end")
        self.record.close()  # what its thread was asked, and the events held back: on disk


class BackwardSteps:
    """A loop's optimizer steps as a framework that sees only its ``backward`` calls counts them (accelerate): step
    ``n`` is computed by the ``backward`` calls after step ``n - 1``'s and ends with the one that syncs the gradients
    (each, without gradient accumulation). Its metrics go to :meth:`FrameworkAudit.tick` once it is over: at the next
    ``backward``, a save, or the end (:meth:`flush`). ``lr``: the learning rate then (after the loop's
    ``scheduler.step()``)."""

    def __init__(self, audit: FrameworkAudit | None, lr: Callable[[], float | None]) -> None:
        self.audit, self.lr = audit, lr
        self.step = 0
        """Optimizer steps ended (restored from a checkpoint by the integration)."""
        self._done: int | None = None
        self._values: dict[str, Any] = {}

    def backward(self, loss: Any, sync: bool) -> None:
        """A ``backward`` of ``loss``; ``sync``: it ends a step (the gradients are synchronised after it)."""
        self.flush()
        step = self.step + 1
        if self.audit is not None and self.audit.wants(step):
            self._values["loss"] = loss.detach() if hasattr(loss, "detach") else loss
        if sync:
            self.step = self._done = step

    def grad_norm(self, norm: Any) -> None:
        """The norm ``clip_grad_norm_`` returned for the step just ended."""
        if self._done is not None and self._values:
            self._values["grad_norm"] = norm.detach() if hasattr(norm, "detach") else norm

    def flush(self) -> None:
        """The step ended last, to the audit (once)."""
        done, values = self._done, self._values
        self._done, self._values = None, {}
        if done is not None and self.audit is not None and values:
            lr = self.lr()
            if lr is not None:
                values["lr"] = lr
            self.audit.tick(done, values)
