"""What ckptio holds with ``flock`` (the kernel releases it when the process dies, however it dies).

**One writer per checkpoint folder**: an advisory ``flock`` on ``<checkpoint_dir>/.ckptio.lock``.

The kernel releases the lock when the holding process dies, so a crash never leaves a stale lock.
A second job pointed at the same folder by mistake gets a clear error naming the holder instead of
interleaving its saves, sweeps and deletions with the first job's. (``flock`` is local to a host on
some network filesystems; there, keep one job per folder by configuration.)

The lock file is opened with ``O_NOFOLLOW`` and must be a regular file with a single link: a symbolic
link or a hard link planted in its place is refused, so taking the lock can never truncate or write
another file. Within one process the lock is shared: a second manager on the same folder (a notebook
cell run again, an evaluation manager beside the training one) takes it too, and it is released when
the last holder releases it; other processes are still refused.

**Scratch folders that a killed process does not leave behind for good** (:class:`Scratch`). An S3 upload spools each
file locally while it is written (:mod:`ckptio.storage.objstore.writer`): a save killed midway (``SIGKILL``, the OOM killer,
a preempted node's job) leaves its spool, up to a checkpoint's worth of bytes per rank, and every preemption adds one.
So each scratch folder holds a file, ``owner.lock``, that its process keeps locked while the folder is in use. The
first scratch folder a process makes sweeps the system's temporary folder once: a ``ckptio-*`` folder of this user
whose lock nobody holds belonged to a dead process and is removed. A folder without the lock file (still being made,
or made by an older ckptio) is left alone; the lock file appears, already locked, by a rename.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import stat
import tempfile
import threading
import weakref
from pathlib import Path

from .._log import get_logger
from ..errors import CheckpointError

LOCK_NAME = ".ckptio.lock"
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

# (device, inode) of a lock file this process holds -> [descriptor, number of holders]
_held: dict[tuple[int, int], list[int]] = {}
_held_lock = threading.Lock()


class CheckpointDirLocked(CheckpointError, BlockingIOError):
    """Another process holds the checkpoint folder."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parse_holder(text: str) -> tuple[int | None, str | None]:
    """(pid, host) from the lock file's ``pid N on HOST`` line."""
    parts = text.split()
    if len(parts) >= 4 and parts[0] == "pid" and parts[2] == "on" and parts[1].isdigit():
        return int(parts[1]), parts[3]
    return None, None


class DirectoryLock:
    """One writer per checkpoint folder: an exclusive lock on a file naming its holder, refused while another
    process holds it."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._key: tuple[int, int] | None = None
        self.forced_over: str | None = None
        """The holder whose lock ``acquire(force=True)`` went past (``None`` when the lock was taken)."""

    @property
    def held(self) -> bool:
        return self._key is not None or self.forced_over is not None

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise CheckpointError(f"{self.path} is a symbolic link; ckptio refuses to follow it for its lock "
                                      "(remove it: the lock file is ckptio's own)") from None
            raise CheckpointError(f"cannot open the lock file {self.path}: {exc}") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"has {st.st_nlink} hard links"
            raise CheckpointError(f"{self.path} {what}; ckptio refuses to use it as its lock (remove it: the lock "
                                  "file is ckptio's own)")
        return fd

    def acquire(self, *, force: bool = False) -> None:
        """Take the lock, or raise :class:`CheckpointDirLocked` naming the holder.

        ``force``: go on without the lock when its recorded holder is gone (a process of this host that no
        longer runs, or a holder on another host, which cannot be checked from here); a holder that is
        alive on this host is never overridden.
        """
        if self.held:
            return
        fd = self._open()
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with _held_lock:
            if key in _held:  # this process holds it already: share it
                os.close(fd)
                _held[key][1] += 1
                self._key = key
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                pid, host = parse_holder(holder)
                if force and not (host == socket.gethostname() and pid is not None and _alive(pid)):
                    self.forced_over = holder
                    return
                raise CheckpointDirLocked(
                    f"{self.path.parent} is in use by {holder}; two jobs must not share a checkpoint_dir "
                    "(give this run its own checkpoint_dir, or stop the other job"
                    + (")" if host == socket.gethostname() and pid is not None and _alive(pid)
                       else "; if that holder is gone, --force goes ahead)")
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            _held[key] = [fd, 1]
            self._key = key

    def release(self) -> None:
        self.forced_over = None
        if self._key is None:
            return
        with _held_lock:
            entry = _held.get(self._key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    os.close(entry[0])  # closing the descriptor drops the flock
                    del _held[self._key]
        self._key = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


# ------------------------------------------------------------------------------------------ scratch folders
SCRATCH_LOCK = "owner.lock"
_swept: set[str] = set()
_sweeping = threading.Lock()


class Scratch:
    """A fresh folder ``<tmp>/<prefix>XXXXXXXX`` held by this process until :meth:`remove` (or garbage collection, or
    exit); then removed. Made in ``dir`` (default: the system's temporary folder), swept first once per process."""

    def __init__(self, prefix: str, dir: str | os.PathLike | None = None) -> None:
        root = os.fspath(dir) if dir is not None else tempfile.gettempdir()
        with _sweeping:
            if root not in _swept:
                _swept.add(root)
                sweep(root)
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        fresh = self.path / f"{SCRATCH_LOCK}.new"
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(fresh, self.path / SCRATCH_LOCK)  # a sweeper sees the lock file only once it is locked
        except BaseException:
            os.close(fd)
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        self._remove = weakref.finalize(self, _remove, str(self.path), fd)

    def remove(self) -> None:
        """Remove the folder and release it (idempotent)."""
        self._remove()


def _remove(path: str, fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)


def sweep(root: str) -> list[Path]:
    """Remove the ``ckptio-*`` scratch folders of this user in ``root`` whose lock no live process holds; returns
    them. Nothing else is touched: not another user's folder, not a link, not a folder without the lock file."""
    removed: list[Path] = []
    freed = 0
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith("ckptio-"):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, SCRATCH_LOCK), os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its process is alive
        try:
            freed += _size(entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
        finally:
            os.close(fd)
    if removed:
        get_logger().info("Removed %d scratch folder(s) of killed processes from %s (%.1f MB)", len(removed), root,
                          freed / 1e6)
    return removed


def _size(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total
