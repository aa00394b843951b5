"""The background writer of async saves: one save in flight, its own process group, errors kept.

Call sequence: the manager constructs one :class:`BackgroundWriter` on every rank (a collective when a
process group is initialised: it builds a gloo group), then calls :meth:`start` and :meth:`wait` at the
same points on every rank. Not thread-safe: both are called from the training thread. The work runs on
a non-daemon thread, so a normal interpreter exit finishes it; an atexit hook then reports its error.

:meth:`close` waits, then destroys the writer's group, so that nothing ckptio started is alive when the interpreter
tears down: no thread of ours running, no gloo group of ours left for the interpreter's teardown to destroy (its
worker threads and sockets are then shut down here, in order, not by a destructor at exit). The atexit hook does
the same for a writer that was never closed.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from pathlib import Path
from typing import Callable

from .. import _dist

__all__ = ["BackgroundWriter"]


class _Pending:
    def __init__(self, label: Path) -> None:
        self.label = label
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None


class BackgroundWriter:
    """Runs a save's write phase on a background thread, one at a time: the next save, restore or close waits for it
    and raises its failure. The manager makes it at its first background save (a collective: it builds a gloo
    group), so that a manager used only to restore starts no thread and creates no process group."""

    def __init__(self, log: logging.Logger, what: str = "save", deferred: bool = False) -> None:
        self.log = log
        self.what = what
        if deferred and _dist.rank() == 0:  # said once, at the first background save: where users look
            log.info("Saving in the background: the parameters and optimizer state are copied after save() returns, "
                     "until the next optimizer.step(); change them in place before then only after "
                     "mgr.wait_for_staging(), or the change fails that save or, where ckptio cannot see it (a few elements "
                     "changed through .data), lands in that checkpoint")
        self._pending: _Pending | None = None
        self._group = None
        self._closed = False
        if _dist.is_dist():
            # its collectives never interleave with the training loop's on the default group
            self._group = _dist.new_gloo_group()
        atexit.register(_wait_at_exit, weakref.ref(self))

    @property
    def group(self) -> object:
        """This writer's process group (gloo; ``None`` in one process): its collectives never meet the training
        loop's. Usable from the training thread while nothing is in flight."""
        return self._group

    @property
    def in_flight(self) -> bool:
        """Whether work has been started and not yet waited for."""
        return self._pending is not None

    def start(self, label: Path, work: Callable[[], None]) -> None:
        """Run ``work`` on a background thread, its collectives on this writer's group. Wait first."""
        if self._closed:
            raise RuntimeError(f"this background {self.what} writer is closed")
        self.wait()
        pending = self._pending = _Pending(label)

        def run() -> None:
            try:
                with _dist.using_group(self._group):
                    work()
            except BaseException as exc:  # kept for the training thread: raised at its next wait
                pending.error = exc
                self.log.error("Background %s to %s failed: %s (raised at the next save, wait or close)",
                               self.what, label, _dist.format_exc_short(exc))

        pending.thread = threading.Thread(target=run, name=f"ckptio-save-{label.name}", daemon=False)
        pending.thread.start()

    def close(self) -> None:
        """Wait for the work in flight (raising its error), then destroy this writer's process group. Idempotent; the
        writer takes no work after it."""
        self._closed = True
        try:
            self.wait()
        finally:
            group, self._group = self._group, None
            if group is not None:
                _dist.destroy_group(group)

    def wait(self) -> Path | None:
        """Block until the work in flight is done; re-raise its error. Returns its label (``None``: idle)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        assert pending.thread is not None
        pending.thread.join()
        if pending.error is not None:
            pending.error.add_note(f"raised by the background {self.what} to {pending.label}")
            raise pending.error
        return pending.label


def _wait_at_exit(ref: "weakref.ref[BackgroundWriter]") -> None:
    writer = ref()
    if writer is None:
        return
    try:
        writer.close()
    except BaseException as exc:  # noqa: BLE001 - at exit there is no caller left to raise to
        writer.log.error("The last background %s failed: %s", writer.what, _dist.format_exc_short(exc))
