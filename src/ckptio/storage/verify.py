"""Checking a load against the manifest's checksums while it reads: no second pass in the usual case.

A :class:`Verifier` is attached to the :class:`~ckptio.storage.confined.Folder` a load reads through.
Every handle opened on a file that has a recorded checksum feeds a running CRC-32C of that file with
the bytes read, as long as they come in file order (small reads ahead of the position, such as a zip
reader looking at a record's end first, are kept aside until their turn; small holes a reader skipped
are read in passing). Long reads are hashed in pieces on a helper thread while the next piece is read.
:meth:`Verifier.finish` then reads only what was not read in order, and compares.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from .checksum import RunningChecksum
from .confined import Folder

if TYPE_CHECKING:
    from .confined import ReadHandle

__all__ = ["Verifier", "finishers"]

_CHUNK = 8 * 1024 * 1024


class _Hash:
    """CRC-32C of a file's bytes read in order from its start.

    Reads usually come in file order; a small read ahead of the hashed position (a zip reader looking at
    the end of a record before its body, as ``torch.load`` does inside DCP files) is kept aside and
    consumed when the hashed position reaches it. Anything else out of order is left for
    :meth:`Verifier.finish` to read again.
    """

    SMALL = 1 << 20
    BUDGET = 64 << 20
    BACKLOG = 256 << 20
    """Bytes read but not hashed yet, at most (their buffers are the reads' destinations, held until hashed)."""
    GAP = 64 << 10
    """A hole of up to this many bytes before a read (padding a reader skipped) is read and hashed in passing."""

    def __init__(self, pool: "Any | None" = None) -> None:
        self.running = RunningChecksum()
        self.lock = threading.Lock()
        self.queue_lock = threading.Lock()
        self.pool = pool
        self.pending: dict[int, bytes] = {}
        self.pending_bytes = 0
        self.backlog: deque[tuple[Any, int]] = deque()
        self.backlog_bytes = 0

    def submit(self, offset: int, view: memoryview, handle: "ReadHandle") -> None:
        """Hash ``view`` (the bytes at ``offset``) on the verifier's thread, after every piece submitted before.

        The pieces not hashed yet keep their buffers alive; past :attr:`BACKLOG` bytes of them, this waits
        for the oldest, so a reader faster than the hash never holds much memory that way.
        """
        if self.pool is None:
            self.update(offset, view, handle)
            return
        future = self.pool.submit(self.update, offset, view, handle)
        with self.queue_lock:
            self.backlog.append((future, view.nbytes))
            self.backlog_bytes += view.nbytes
        while self.backlog_bytes > self.BACKLOG:
            self._wait_oldest()

    def idle(self) -> bool:
        """Nothing submitted is still waiting to be hashed (so a read may be hashed on the caller's thread)."""
        while self.backlog and self.backlog[0][0].done():
            self._wait_oldest()
        return not self.backlog

    def wait(self) -> None:
        """Every piece submitted so far has been hashed."""
        while self.backlog:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        with self.queue_lock:
            if not self.backlog:
                return
            future, n = self.backlog.popleft()
            self.backlog_bytes -= n
        future.result()

    def update(self, offset: int, view: memoryview, handle: "ReadHandle") -> None:
        with self.lock:
            end = self.running.size
            n = view.nbytes
            if end < offset <= end + self.GAP:
                self._fill(end, offset - end, handle)
                end = offset
            if offset <= end < offset + n:
                self.running.update(view[end - offset:])
                self._drain(handle)
            elif offset > end and n <= self.SMALL and self.pending_bytes + n <= self.BUDGET \
                    and offset not in self.pending:
                self.pending[offset] = bytes(view)
                self.pending_bytes += n

    def _fill(self, start: int, n: int, handle: "ReadHandle") -> None:
        gap = bytearray(n)
        handle._pread(memoryview(gap), start)
        self.running.update(gap)

    def _drain(self, handle: "ReadHandle") -> None:
        while self.pending:
            end = self.running.size
            first = min(self.pending)
            if first > end + self.GAP:
                return
            if first > end:
                self._fill(end, first - end, handle)
                end = first
            piece = self.pending.pop(first)
            self.pending_bytes -= len(piece)
            if first <= end < first + len(piece):
                self.running.update(memoryview(piece)[end - first:])


class Verifier:
    """Checks the files read during a load against their recorded checksums, hashing as they are read.

    Attach it to the :class:`Folder` a load reads through; every handle opened on a file that has a
    recorded checksum hashes the bytes read in order from the start of the file. :meth:`finish` then
    reads, for each file this process is responsible for, whatever was not read in order, and returns
    the problems found (one line each, naming the file).
    """

    def __init__(self, root: Folder, checksums: dict[str, str]) -> None:
        self.root = root
        self.checksums = dict(checksums)
        self._hashes: dict[str, _Hash] = {}
        self._lock = threading.Lock()
        self._pool: Any = None

    def _attach(self, folder: Folder, rel: str, handle: ReadHandle) -> None:
        try:
            full = (folder.path / rel).relative_to(self.root.path).as_posix()
        except ValueError:
            return
        if full not in self.checksums:
            return
        with self._lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptio-verify")
            h = self._hashes.setdefault(full, _Hash(self._pool))
        handle._hash = h

    def settle(self) -> None:
        """Wait until every byte read so far is hashed (a failed piece is simply read again by :meth:`finish`)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for h in self._hashes.values():
            h.pool = None  # a read after this hashes on the reader's thread
            h.backlog.clear()
            h.backlog_bytes = 0

    def hashed(self) -> dict[str, int]:
        """For each file some handle read: how many bytes from its start are hashed (after :meth:`settle`)."""
        self.settle()
        return {rel: h.running.size for rel, h in self._hashes.items()}

    def finish(self, files: list[str], progress: "Any | None" = None) -> list[str]:
        """Complete and compare the checksums of ``files``; return the problems (empty: all good)."""
        self.settle()
        problems = []
        plain = self.root.plain()  # no verifier: the tail reads hash below
        for rel in files:
            want = self.checksums.get(rel)
            if want is None:
                continue
            h = self._hashes.get(rel) or _Hash()
            try:
                with plain.open(rel) as handle:
                    pos = h.running.size
                    buf = bytearray(min(_CHUNK, max(1, handle.size - pos)))
                    while pos < handle.size:
                        n = min(len(buf), handle.size - pos)
                        view = memoryview(buf)[:n]
                        handle.readinto(view, pos)
                        h.running.update(view)
                        pos += n
                        if progress is not None:
                            progress(n)
            except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
                problems.append(str(exc))
                continue
            if h.running.digest != want:
                problems.append(f"{self.root.path / rel}: checksum {h.running.digest}, manifest says {want} (corrupted)")
        return problems


def finishers(hashed: list[dict[str, int]]) -> list[list[str]]:
    """Which rank completes which file's checksum, from every rank's :meth:`Verifier.hashed`.

    Each file goes to the rank that hashed most of it (the lowest such rank on a tie): the others read
    little of it, often just its header while planning, and the finisher only reads what it has not hashed.
    """
    best: dict[str, tuple[int, int]] = {}
    for rank, files in enumerate(hashed):
        for rel, n in files.items():
            if rel not in best or n > best[rel][0]:
                best[rel] = (n, rank)
    out: list[list[str]] = [[] for _ in hashed]
    for rel in sorted(best):
        out[best[rel][1]].append(rel)
    return out
