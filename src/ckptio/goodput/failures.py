"""Saves that fail without ending the run (``CheckpointConfig.failed_saves_allowed``).

A background save (``async_save``) or a memory-tier snapshot that fails — a full disk, a bucket that refuses, an
in-place edit the staging copies caught — used to raise at the next ``save()``, ending a run that had hours left.
Now its error is logged, recorded in the run's record (a ``save_failed`` event, shown by ``ckptio report``) and
training goes on: the next interval saves again. Only when ``failed_saves_allowed`` saves of one tier have failed in
a row does the next one raise the last error. A synchronous save raises at once unless ``sync_saves_may_fail``.
Only failures that the next save may not meet again are tolerated (:func:`tolerable`): the storage's, or a save
refused for an edit made meanwhile; a state that cannot be stored fails every save alike and raises at once.

Nothing of a failed save is committed either way (a save commits by its manifest, written last), so what this
tolerates is the absence of one checkpoint, never a torn one. An explicit ``wait()`` and ``close()`` still raise:
they are where a caller asks whether the save committed.

Every rank sees the same failures (a save's errors are gathered and raised on every rank), so their counts agree and
the raise, when it comes, is collective.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .. import _dist
from ..errors import CheckpointError, ConfigError, MissingDependencyError

__all__ = ["SaveFailures"]


class SaveFailures:
    """The failed saves of one manager, counted in a row per tier (``durable``, ``memory``)."""

    def __init__(self, config: Any, log: logging.Logger, emit: Callable[..., None]) -> None:
        self.allowed = config.failed_saves_allowed
        self.sync_may_fail = config.sync_saves_may_fail
        self.log = log
        self.emit = emit
        self.in_a_row: dict[str, int] = {"durable": 0, "memory": 0}
        self.steps: dict[str, int | None] = {"durable": None, "memory": None}
        """The step of the save in flight on each tier (what a failure found at the next wait names)."""

    def settle(self, tier: str, wait: Callable[[], Any]) -> Any:
        """Wait for ``tier``'s save in flight with ``wait``; its failure is logged and counted instead of raised,
        unless it is one more than allowed in a row. Returns what ``wait`` returned (``None`` after a failure)."""
        try:
            done = wait()
        except (OSError, CheckpointError) as exc:
            if not tolerable(exc):
                raise
            self.failed(tier, self.steps[tier], exc)
            return None
        if done is not None:
            self.in_a_row[tier] = 0
        return done

    def settle_all(self, memory: Any, writer: Any) -> None:
        """Before a save: the memory tier's snapshot and the background save in flight (either ``None``: none)."""
        if memory is not None:
            self.settle("memory", memory.wait)
        if writer is not None:
            self.settle("durable", writer.wait)

    def run(self, work: Callable[[], Any], step: int) -> bool:
        """A synchronous durable save: ``work()``; a failure raises unless ``sync_saves_may_fail``. Whether it
        committed."""
        if not self.sync_may_fail:
            work()
            return True
        self.steps["durable"] = step  # a synchronous save has nothing in flight beside it
        return self.settle("durable", lambda: work() or True) is not None

    def failed(self, tier: str, step: int | None, exc: Exception) -> None:
        """Count one failed save of ``tier``; raise ``exc`` once more than :attr:`allowed` failed in a row."""
        self.in_a_row[tier] += 1
        count = self.in_a_row[tier]
        self.emit("save_failed", begin=True, tier=tier, **({"step": step} if step is not None else {}))
        what = "durable save" if tier == "durable" else "memory-tier snapshot"
        at = f" of step {step}" if step is not None else ""
        if count > self.allowed:
            exc.add_note(f"ckptio: {count} {what}s in a row failed, more than failed_saves_allowed={self.allowed}")
            raise exc
        if _dist.rank() == 0:
            self.log.error("The %s%s failed and is not committed: %s. Training goes on and the next %s tries again "
                           "(%d failed in a row; failure %d in a row stops the run: failed_saves_allowed=%d)", what,
                           at, _dist.format_exc_short(exc), what, count, self.allowed + 1, self.allowed)


def tolerable(exc: BaseException) -> bool:
    """Whether a save's failure may let training go on: the storage's (a full disk, a bucket that refuses, a lost
    connection) or a save refused for what happened to it (an in-place edit the staging copies caught). A state that
    cannot be stored (``TypeError``), a configuration or a missing package fails every save alike: raised at once."""
    return isinstance(exc, (OSError, CheckpointError)) and not isinstance(exc, (ConfigError, MissingDependencyError))
