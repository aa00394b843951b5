"""The run's record written off the training thread: one daemon thread per record, at most one write in flight and
one pending (the newest record wins: a request while a write is in flight is served once, with the events of then).

The resume audit's ``metrics`` events end a window at most steps when memory snapshots come every step or two, and
a write of the record (fsynced, renamed over it) costs milliseconds: the training thread only asks for it
(:meth:`BackgroundWrites.request`, microseconds). The thread is started when first needed and ends after
:data:`IDLE_S` seconds with nothing to write (started again at the next request), is a daemon (it never holds up the
interpreter's exit: a write cut short there leaves a ``.tmp`` beside the record, swept by the next run) and is not
inherited by a forked process (:func:`os.register_at_fork`: the child starts its own).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Callable

__all__ = ["BackgroundWrites", "IDLE_S"]

IDLE_S = 2.0
"""Seconds the writer thread waits for a request before it ends."""
_JOIN_S = 30.0
"""What :meth:`BackgroundWrites.close` waits for the thread's last write at most."""


class BackgroundWrites:
    """Calls ``write`` (which writes the newest record and logs, never raises, its failure) on a thread of its own
    when asked."""

    def __init__(self, write: Callable[[], None], name: str) -> None:
        self._write, self._name = write, name
        self._cond = threading.Condition()
        self._pending = self._busy = self._closed = False
        self._thread: threading.Thread | None = None
        _LIVE.add(self)

    def request(self) -> bool:
        """A write of the record, on the thread; ``False`` once closed (the caller writes it itself)."""
        with self._cond:
            if self._closed:
                return False
            self._pending = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
            return True

    def cancel(self) -> None:
        """The caller writes the record now: the write pending is not needed."""
        with self._cond:
            self._pending = False

    def wait(self) -> None:
        """Return once what was asked is written: the write in flight waited for, the one pending made here."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            pending, self._pending = self._pending, False
            self._busy = pending
        if pending:
            self._serve()

    def close(self) -> None:
        """Write what is pending, then end the thread; later requests are refused (written by their caller)."""
        self.wait()
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    self._cond.wait(IDLE_S)
                if not self._pending:  # idle, or closed: the next request starts another thread
                    self._thread = None
                    return
                self._pending, self._busy = False, True
            self._serve()

    def _serve(self) -> None:
        try:
            self._write()
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _forked(self) -> None:
        """In a forked child: the parent's thread is not here, and its locks may have been held at the fork."""
        self._cond = threading.Condition()
        self._pending = self._busy = False
        self._thread = None


_LIVE: "weakref.WeakSet[BackgroundWrites]" = weakref.WeakSet()


def _after_fork() -> None:
    for writes in list(_LIVE):
        writes._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
