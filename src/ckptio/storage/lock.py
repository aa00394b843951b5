"""One writer per checkpoint folder: an advisory ``flock`` on ``<checkpoint_dir>/.ckptio.lock``.

The kernel releases the lock when the holding process dies, so a crash never leaves a stale lock.
A second job pointed at the same folder by mistake gets a clear error naming the holder instead of
interleaving its saves, sweeps and deletions with the first job's. (``flock`` is local to a host on
some network filesystems; there, keep one job per folder by configuration.)
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from ..errors import CheckpointError

LOCK_NAME = ".ckptio.lock"


class CheckpointDirLocked(CheckpointError, BlockingIOError):
    """Another process holds the checkpoint folder."""


class DirectoryLock:
    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        import fcntl

        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CheckpointDirLocked(
                f"{self.path.parent} is in use by {holder}; two jobs must not share a checkpoint_dir "
                "(give this run its own checkpoint_dir, or stop the other job)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()
