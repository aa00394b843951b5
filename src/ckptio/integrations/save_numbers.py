"""Each save's numbers for the framework integrations: what the training loop waited, the whole save, its bytes and
files, handed to the framework's logger under a ``ckpt/`` prefix and to the user's listeners.

The frameworks log from the training thread, and a background save ends on its writer's thread: a save's event is
made where it ends (:class:`SaveTimer`), given at once to every listener, and kept until the integration's
next chance to log it (:meth:`SaveNumbers.drain`). Events are made on the rank that commits the checkpoint (rank 0),
as frameworks log there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..storage import url_scheme

__all__ = ["SaveNumbers", "SaveTimer", "as_metrics", "PREFIX", "folder_size"]

log = logging.getLogger("ckptio")

PREFIX = "ckpt/"
_LOGGED = ("blocked_s", "total_s", "bytes", "files", "step")
_BLOCKED_WAIT_S = 60.0


def as_metrics(event: dict[str, Any]) -> dict[str, float]:
    """The numbers of a save or restore event as a logger takes them: ``ckpt/blocked_s``, ``ckpt/total_s``,
    ``ckpt/bytes``, ``ckpt/files``, ``ckpt/step`` (those it has), plus ``ckpt/restore_s`` and ``ckpt/steps_lost``
    for a restore."""
    names = _LOGGED + ("restore_s", "steps_lost", "startup_s")
    return {PREFIX + name: float(event[name]) for name in names if isinstance(event.get(name), (int, float))}


def folder_size(path: Any) -> tuple[int, int]:
    """Bytes and files under the local folder (or file) ``path``; ``(0, 0)`` for a bucket's or one not there."""
    if isinstance(path, str) and "://" in path:
        return 0, 0
    total, count = 0, 0
    root = Path(path)
    try:
        if root.is_file():
            return root.stat().st_size, 1
        for folder, _dirs, names in os.walk(root):
            for name in names:
                total += os.lstat(os.path.join(folder, name)).st_size
                count += 1
    except OSError:
        pass
    return total, count


class SaveNumbers:
    """The save events of one integration: ``listeners`` are called with each (a dict: ``kind`` ``"save"``,
    ``time``, ``step``, ``tier``, ``blocked_s``, ``total_s``, ``bytes``, ``files``, ``storage``), possibly on a
    background writer's thread; :meth:`drain` hands the ones not yet logged to the training thread."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def start(self, *, step: int, folder: Any) -> "SaveTimer":
        """Time the save of ``folder`` at ``step`` starting now."""
        return SaveTimer(self, step, folder)

    def made(self, *, step: int, blocked_s: float, total_s: float, folder: Any) -> None:
        """A save of ``folder`` at ``step`` is committed: its event is kept for the logger and given to the
        listeners (a listener's error is logged, never raised: it must not fail the save)."""
        size, files = folder_size(folder)
        event = {"kind": "save", "time": round(time.time(), 3), "step": int(step), "tier": "durable",
                 "blocked_s": round(blocked_s, 6), "total_s": round(total_s, 6), "bytes": size, "files": files,
                 "storage": (url_scheme(folder) if isinstance(folder, str) else None) or "local"}
        with self._lock:
            self._pending.append(event)
            del self._pending[:-64]  # a loop that never logs keeps the newest only
        for listener in list(self.listeners):
            try:
                listener(dict(event))
            except Exception as exc:
                log.warning("A checkpoint event listener failed (%s: %s)", type(exc).__name__, exc)

    def drain(self) -> list[dict[str, float]]:
        """The ``ckpt/`` metrics of the saves committed since the last call, oldest first."""
        with self._lock:
            events, self._pending = self._pending, []
        return [as_metrics(e) for e in events]


class SaveTimer:
    """One save being timed: :meth:`wrap` its commit, call :meth:`returned` when the training thread is free."""

    def __init__(self, numbers: SaveNumbers, step: int, folder: Any) -> None:
        self.numbers, self.step, self.folder = numbers, step, folder
        self.called = time.perf_counter()
        self.blocked_s: float | None = None
        self._freed = threading.Event()

    def returned(self) -> None:
        """The save gave the training thread back (a synchronous one is over)."""
        self.blocked_s = time.perf_counter() - self.called
        self._freed.set()

    def wrap(self, commit: Callable[[], object] | None, *, background: bool) -> Callable[[], None] | None:
        """``commit`` made to record the event once it has run (``None`` stays ``None``: this rank does not
        commit); ``background``: it runs on another thread, after :meth:`returned`, else the whole save blocked."""
        if commit is None:
            return None

        def run() -> None:
            commit()
            total = time.perf_counter() - self.called
            if background:
                self._freed.wait(_BLOCKED_WAIT_S)  # the commit may end before save() has quite returned
            blocked = self.blocked_s if background and self.blocked_s is not None else total
            # a small background save can commit before save() returns: the whole save then lasted till the return
            # (the loop waited longer than the commit took; the test of these numbers failed on it)
            self.numbers.made(step=self.step, blocked_s=blocked, total_s=max(total, blocked), folder=self.folder)

        return run
