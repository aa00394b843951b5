"""Checking a load against the manifest's checksums while it reads: no second pass in the usual case.

A :class:`Verifier` is attached to the :class:`~ckptio.storage.confined.Folder` a load reads through.
Every handle opened on a file that has a recorded checksum feeds a running CRC-32C of that file with
the bytes read, as long as they come in file order (small reads ahead of the position, such as a zip
reader looking at a record's end first, are kept aside until their turn; small holes a reader skipped
are read in passing). Long reads are hashed in pieces on a helper thread while the next piece is read.
A rank that reads only parts of a file (the ranks of a restore sharing its reads) hashes each part as a run
of its own; :meth:`Verifier.finish` joins every rank's runs (CRC-32C combines), reads only what no rank
read, and compares.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from crc32c import crc32c

from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from .checksum import RunningChecksum, crc32c_combine, format_digest
from .confined import Folder

if TYPE_CHECKING:
    from .confined import ReadHandle

__all__ = ["Verifier", "finishers"]

_CHUNK = 8 * 1024 * 1024


class _Run:
    """The CRC-32C of the bytes of a file from ``start`` on, as far as they were read without a gap."""

    __slots__ = ("start", "crc")

    def __init__(self, start: int) -> None:
        self.start = start
        self.crc = RunningChecksum()

    @property
    def end(self) -> int:
        return self.start + self.crc.size


class _Hash:
    """CRC-32C of a file's bytes as this process reads them, in runs.

    Reads usually come in file order, and extend the run they continue; a small read ahead of a run (a zip
    reader looking at the end of a record before its body, as ``torch.load`` does inside DCP files) is kept
    aside and consumed when a run reaches it. A large read that continues no run starts a run of its own
    (several ranks sharing a file's reads each read parts of it); runs that meet are joined (CRC-32C
    combines). What no run covers is read by :meth:`Verifier.finish`, which joins every rank's runs.
    """

    SMALL = 1 << 20
    BUDGET = 64 << 20
    BACKLOG = 256 << 20
    """Bytes read but not hashed yet, at most (their buffers are the reads' destinations, held until hashed)."""
    GAP = 64 << 10
    """A hole of up to this many bytes before a read (padding a reader skipped) is read and hashed in passing."""

    def __init__(self, pool: "Any | None" = None) -> None:
        self.runs: list[_Run] = []
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

    @property
    def size(self) -> int:
        """Bytes hashed, over every run."""
        return sum(r.crc.size for r in self.runs)

    def _reaching(self, offset: int) -> "_Run | None":
        """The run a read at ``offset`` continues: it starts at or before it and ends at most :attr:`GAP` before."""
        for run in self.runs:
            if run.start <= offset <= run.end + self.GAP:
                return run
        return None

    def update(self, offset: int, view: memoryview, handle: "ReadHandle") -> None:
        with self.lock:
            n = view.nbytes
            run = self._reaching(offset)
            if run is None and offset <= self.GAP and not any(r.start == 0 for r in self.runs):
                run = _Run(0)  # the file's start
                self.runs.append(run)
            if run is None:
                if n <= self.SMALL and self.pending_bytes + n <= self.BUDGET and offset not in self.pending:
                    self.pending[offset] = bytes(view)
                    self.pending_bytes += n
                    return
                run = self._start(offset, handle)
            end = run.end
            if end < offset:
                self._fill(run, offset - end, handle)
                end = offset
            if offset <= end < offset + n:
                run.crc.update(view[end - offset:])
            self._drain(run, handle)

    def _start(self, offset: int, handle: "ReadHandle") -> _Run:
        """A new run for a large read at ``offset``, from the piece kept aside just before it when there is one
        (the head of a record read before its body)."""
        before = [p for p in self.pending if p < offset <= p + len(self.pending[p]) + self.GAP]
        if not before:
            run = _Run(offset)
        else:
            first = max(before)
            piece = self.pending.pop(first)
            self.pending_bytes -= len(piece)
            run = _Run(first)
            run.crc.update(memoryview(piece)[:offset - first])
        self.runs.append(run)
        self.runs.sort(key=lambda r: r.start)
        return run

    def _fill(self, run: _Run, n: int, handle: "ReadHandle") -> None:
        gap = bytearray(n)
        handle._pread(memoryview(gap), run.end)
        run.crc.update(gap)

    def _drain(self, run: _Run, handle: "ReadHandle") -> None:
        """Extend ``run`` with the pieces kept aside and the runs it has reached."""
        while True:
            end = run.end
            later = [p for p in self.pending if run.start <= p <= end + self.GAP]
            ahead = [r for r in self.runs if r is not run and run.start < r.start <= end + self.GAP]
            if later and (not ahead or min(later) <= min(r.start for r in ahead)):
                first = min(later)
                piece = self.pending.pop(first)
                self.pending_bytes -= len(piece)
                if first > end:
                    self._fill(run, first - end, handle)
                    end = first
                if first <= end < first + len(piece):
                    run.crc.update(memoryview(piece)[end - first:])
                continue
            if not ahead:
                return
            nxt = min(ahead, key=lambda r: r.start)
            if nxt.end <= end:  # read twice: already covered
                self.runs.remove(nxt)
                continue
            if nxt.start < end:  # overlaps: a CRC cannot be cut, so the two stay apart
                return
            if nxt.start > end:
                self._fill(run, nxt.start - end, handle)
            run.crc.value = crc32c_combine(run.crc.value, nxt.crc.value, nxt.crc.size)
            run.crc.size += nxt.crc.size
            self.runs.remove(nxt)

    def settled_runs(self) -> list[tuple[int, int, int]]:
        """Every run as (start, bytes, CRC-32C), the pieces still kept aside hashed as runs of their own."""
        with self.lock:
            for offset, piece in sorted(self.pending.items()):
                if any(r.start <= offset and offset + len(piece) <= r.end for r in self.runs):
                    continue
                run = _Run(offset)
                run.crc.update(piece)
                self.runs.append(run)
            self.pending.clear()
            self.pending_bytes = 0
            self.runs.sort(key=lambda r: r.start)
            return [(r.start, r.crc.size, r.crc.value) for r in self.runs if r.crc.size]


Runs = list[tuple[int, int, int]]
"""Hashed runs of one file: (start, bytes, CRC-32C of those bytes)."""


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
        # by parts: an object store's path prints with its scheme (s3://…), so relative_to(...).as_posix() would not
        # name the manifest's file there, and no byte read from a bucket would be checked
        parts, root = (folder.path / rel).parts, self.root.path.parts
        if parts[:len(root)] != root:
            return
        full = "/".join(parts[len(root):])
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
        """For each file some handle read: how many bytes of it are hashed (after :meth:`settle`)."""
        return {rel: sum(n for _, n, _ in runs) for rel, runs in self.runs().items()}

    def runs(self) -> dict[str, Runs]:
        """For each file some handle read: the runs of it hashed, as (start, bytes, CRC-32C) (after :meth:`settle`).
        What the ranks of a load share, so that a file's finisher reads only what no rank hashed."""
        self.settle()
        return {rel: h.settled_runs() for rel, h in self._hashes.items()}

    def finish(self, files: "list[str] | dict[str, Runs]", progress: "Any | None" = None) -> list[str]:
        """Complete and compare the checksums of ``files``; return the problems (empty: all good).

        ``files`` as a dict gives, for each file, the runs other processes hashed (every rank's
        :meth:`runs`); this process's own runs are used either way, and only what no run covers is read."""
        shared = files if isinstance(files, dict) else {}
        own = self.runs()
        problems = []
        plain = self.root.plain()  # no verifier: the tail reads hash below
        for rel in files:
            want = self.checksums.get(rel)
            if want is None:
                continue
            runs = list(own.get(rel, [])) + list(shared.get(rel, []))
            try:
                with plain.open(rel) as handle:
                    digest = _complete(handle, runs, progress)
            except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
                problems.append(str(exc))
                continue
            if digest != want:
                problems.append(f"{self.root.path / rel}: checksum {digest}, manifest says {want} (corrupted)")
        return problems


def _complete(handle: "ReadHandle", runs: Runs, progress: "Any | None") -> str:
    """The digest of the whole file: the hashed runs joined where they meet, the rest read (in order)."""
    starts: dict[int, tuple[int, int]] = {}  # start -> the longest run from there (size, crc)
    for start, n, crc in runs:
        if n > 0 and start + n <= handle.size and n > starts.get(start, (0, 0))[0]:
            starts[start] = (n, crc)
    order = sorted(starts)
    pieces: list[tuple[int, int, int | None]] = []  # (start, end, CRC-32C of a run | None: to be read)
    pos = 0
    while pos < handle.size:
        if pos in starts:
            n, crc = starts[pos]
            pieces.append((pos, pos + n, crc))
            pos += n
            continue
        stop = next((s for s in order if s > pos), handle.size)
        pieces.append((pos, stop, None))
        pos = stop
    handle.advise([(a, b) for a, b, known in pieces if known is None])  # an object store fetches just these
    value, buf = 0, None
    for lo, hi, known in pieces:
        if known is not None:
            value = crc32c_combine(value, known, hi - lo)
            continue
        if buf is None:
            buf = bytearray(min(_CHUNK, handle.size))
        while lo < hi:
            n = min(len(buf), hi - lo)
            view = memoryview(buf)[:n]
            handle.readinto(view, lo)
            value = crc32c(view, value)
            lo += n
            if progress is not None:
                progress(n)
    return format_digest(value)


def finishers(hashed: "list[dict[str, Any]]") -> list[list[str]]:
    """Which rank completes which file's checksum, from every rank's :meth:`Verifier.hashed` (bytes) or
    :meth:`~Verifier.runs` (runs).

    Each file goes to the rank that hashed most of it (the lowest such rank on a tie): the others read
    little of it, often just its header while planning, and the finisher only reads what no rank hashed.
    """
    best: dict[str, tuple[int, int]] = {}
    for rank, files in enumerate(hashed):
        for rel, n in files.items():
            size = n if isinstance(n, int) else sum(r[1] for r in n)
            if rel not in best or size > best[rel][0]:
                best[rel] = (size, rank)
    out: list[list[str]] = [[] for _ in hashed]
    for rel in sorted(best):
        out[best[rel][1]].append(rel)
    return out
