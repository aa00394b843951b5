"""Progress of long work: a redrawn bar on a terminal, plain lines when the output is piped or logged.

A bar that redraws itself is unreadable in a CI log or a file; there, the same progress comes out as a
line at every tenth of the work (``consolidating: 40% (1.9 GB of 4.8 GB, 3.1 s)``). The commands print
those lines to stderr; the library (a large restore) sends them to the ``ckptio`` logger instead, so they
land wherever the user's logging goes.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable


class _Lines:
    def __init__(self, total: int, desc: str, emit: Callable[[str], None]) -> None:
        self.total, self.desc, self.done, self.next_tenth, self.start = max(total, 1), desc, 0, 1, time.perf_counter()
        self.emit = emit

    def update(self, n: int) -> None:
        from .cli._fmt import human_bytes

        self.done += n
        tenth = min(10, self.done * 10 // self.total)  # one line for the tenth reached, never one per tenth passed
        if tenth >= self.next_tenth:
            self.emit(f"{self.desc}: {tenth * 10}% ({human_bytes(self.done)} of {human_bytes(self.total)}, "
                      f"{time.perf_counter() - self.start:.1f} s)")
            self.next_tenth = tenth + 1

    def close(self) -> None:
        pass


class _Off:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def progress(total: int, desc: str, *, enabled: bool = True, log: Callable[[str], None] | None = None) -> Any:
    """An object with ``update(bytes)`` and ``close()``: a tqdm bar when stderr is a terminal, otherwise a
    line per tenth of ``total`` (to stderr, or to ``log`` when given); nothing for work under
    :func:`min_bytes` (short work shows no progress, on the command line as in the library)."""
    if not enabled or total < min_bytes():
        return _Off()
    if sys.stderr.isatty():
        from tqdm import tqdm

        try:  # a terminal that reports no size (some consoles, a fresh pty) would get no bar at all
            size = os.get_terminal_size(sys.stderr.fileno())
        except OSError:
            size = os.terminal_size((0, 0))
        return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=log is None,
                    ncols=None if size.columns > 0 else 100, nrows=None if size.lines > 0 else 24)
    return _Lines(total, desc, log or _stderr_line)


PROGRESS_MIN_BYTES = 1 << 30
"""Work of at least this many bytes shows its progress (a command's, or a state's restore on rank 0: a bar on a
terminal, a line per tenth otherwise); ``CKPTIO_PROGRESS_MIN_BYTES`` in the environment overrides it."""


def min_bytes() -> int:
    """:data:`PROGRESS_MIN_BYTES`, or ``CKPTIO_PROGRESS_MIN_BYTES`` from the environment."""
    setting = os.environ.get("CKPTIO_PROGRESS_MIN_BYTES", "")
    return int(setting) if setting.strip().isdigit() else PROGRESS_MIN_BYTES


class StateProgress:
    """The progress of filling one state's tensors (plain or DTensor; others are not counted) during a restore,
    reported by rank 0 when the state is large. ``update`` may be called from I/O threads."""

    def __init__(self, tensors: dict[str, Any], desc: str, log: Any) -> None:
        import threading

        from . import _dist

        local = [getattr(t, "to_local", lambda t=t: t)() for t in tensors.values()]
        total = sum(t.numel() * t.element_size() for t in local if hasattr(t, "element_size"))
        enabled = _dist.rank() == 0 and total > 0
        self.bar = progress(total, desc, enabled=enabled, log=log.info)
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:  # the reads may report from I/O threads
            self.bar.update(n)

    def __enter__(self) -> "StateProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
