"""Progress of long commands: a redrawn bar on a terminal, plain lines when the output is piped or logged.

A bar that redraws itself is unreadable in a CI log or a file; there, the same progress comes out as a
line at every tenth of the work (``consolidating: 40% (1.9 GB of 4.8 GB, 3.1 s)``).
"""

from __future__ import annotations

import sys
import time
from typing import Any


class _Lines:
    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done, self.next_tenth, self.start = max(total, 1), desc, 0, 1, time.perf_counter()

    def update(self, n: int) -> None:
        from ._fmt import human_bytes

        self.done += n
        while self.next_tenth <= 10 and self.done * 10 >= self.total * self.next_tenth:
            print(f"{self.desc}: {self.next_tenth * 10}% ({human_bytes(self.done)} of {human_bytes(self.total)}, "
                  f"{time.perf_counter() - self.start:.1f} s)", file=sys.stderr, flush=True)
            self.next_tenth += 1

    def close(self) -> None:
        pass


class _Off:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, *, enabled: bool = True) -> Any:
    """An object with ``update(bytes)`` and ``close()``: a tqdm bar on a terminal, lines otherwise."""
    if not enabled:
        return _Off()
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)
    return _Lines(total, desc)
