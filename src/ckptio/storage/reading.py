"""How the bytes of a :class:`~ckptio.storage.confined.ReadHandle` are read: as a file object
(:class:`HandleStream`), and, for a cold file, around the page cache with several ``O_DIRECT`` reads in flight
ahead of the reader (:class:`ReadAhead`).

A restore reads most of its bytes in large, known ranges (:meth:`~ckptio.storage.confined.ReadHandle.advise`).
When those ranges are large and the page cache does not hold them (a restore after a reboot, on a new node, or
of a checkpoint written long ago), a plain read has the kernel fill fresh page-cache pages and copy out of
them, one read at a time: on the machines measured (``docs/benchmarks.md``) filling the page cache cost more
CPU than the disk took, and the restore's own work waited behind it. A :class:`ReadAhead` instead keeps
:data:`DEPTH` aligned reads of :data:`PIECE` bytes in flight on threads of its own, straight from the disk
into reused buffers, while the reader copies the piece it needs out of them.

It is off unless ``CKPTIO_DIRECT_READS=1`` is set (:func:`mode`): what it reads does not stay in the page cache,
so a second restore of the same files on the same node reads the disk again (measured: a restore right after a
cold one took ×1.4 AutoModel's warm restore instead of ×0.45). Where it is on, it is an optimisation only, and it
never decides what a read returns:

* it is used only for a local file whose advised ranges add up to :data:`MIN_BYTES` or more and of which less
  than half is in the page cache (``mincore``); a warm file keeps reading from memory;
* the second descriptor is opened through ``/proc/self/fd`` of the one the read gate opened, and used only when
  it is the same file (device and inode): no path is resolved again;
* a read it does not hold (before its window, outside the advised ranges, a small read far ahead) is a plain
  read, as is every read after one of its reads failed or came back short: the plain read then reports
  the truncation or the error, naming the file.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import io
import mmap
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

__all__ = ["ReadAhead", "start", "mode", "cached_fraction", "HandleStream", "NegativeSeek", "PIECE", "DEPTH",
           "MIN_BYTES", "STATS"]

PIECE = 8 << 20
"""Bytes of one direct read."""
DEPTH = 4
"""Direct reads in flight (and buffers held) per file being read."""
MIN_BYTES = 64 << 20
"""Advised ranges smaller than this in all are read through the page cache."""
SMALL = 64 << 10
"""A read this small ahead of the window is a plain read and does not move the window (a DCP item's directory,
read before its bytes)."""
ALIGN = 4096
FORCED_PIECE = 16 * ALIGN
"""The piece of ``CKPTIO_DIRECT_READS=force``: small, so that small test files span many pieces."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_spare: list[mmap.mmap] = []
_lock = threading.Lock()
STATS = {"files": 0, "bytes": 0}
"""Files this process began to read ahead, and bytes served from those reads (for tests and benchmarks)."""


def mode() -> str:
    """``"off"`` (the default, or no ``O_DIRECT`` here), ``"auto"`` (``CKPTIO_DIRECT_READS=1``: direct reads for
    large ranges the page cache does not hold), or ``"force"`` (``CKPTIO_DIRECT_READS=force``: every advised range
    of a local file, cached or not, in pieces of :data:`FORCED_PIECE`; for tests and the fuzzer)."""
    setting = os.environ.get("CKPTIO_DIRECT_READS", "0").strip().lower()
    if not _O_DIRECT or not sys.platform.startswith("linux") or setting not in ("1", "on", "auto", "force"):
        return "off"
    return "force" if setting == "force" else "auto"


def _buffers(n: int, piece: int) -> list[mmap.mmap]:
    """``n`` page-aligned buffers of ``piece`` bytes; kept for the next file (touching fresh memory costs)."""
    with _lock:
        same = [b for b in _spare if len(b) == piece][:n]
        for b in same:
            _spare.remove(b)
    return same + [mmap.mmap(-1, piece) for _ in range(n - len(same))]


def _give_back(bufs: list[mmap.mmap]) -> None:
    with _lock:
        keep = max(0, DEPTH - len(_spare))
        _spare.extend(bufs[:keep])
    for b in bufs[keep:]:
        try:
            b.close()
        except BufferError:  # still exported somewhere: the collector frees it later
            pass


_libc: Any = None


def cached_fraction(fd: int, size: int, spans: list[tuple[int, int]]) -> float | None:
    """Share of the pages of ``spans`` (byte ranges of the file open as ``fd``) in the page cache, or ``None`` when
    the system cannot say."""
    global _libc
    if not spans or size <= 0:
        return None
    try:
        if _libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            _libc = libc
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    except (OSError, AttributeError):
        return None
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        page = mmap.PAGESIZE
        vec = ctypes.create_string_buffer((size + page - 1) // page)
        if _libc.mincore(addr, size, vec) != 0:
            return None
        resident = total = 0
        pages = vec.raw
        for start, end in spans:
            states = pages[max(0, start) // page:(min(end, size) + page - 1) // page]
            total += len(states)
            resident += len(states) - states.count(0)  # the low bit tells; the others are reserved (0)
        return resident / total if total else None
    finally:
        _libc.munmap(addr, size)


def _reopen(fd: int) -> int | None:
    """A second, ``O_DIRECT`` descriptor of the file open as ``fd`` (never through its path), or ``None``."""
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # no /proc, or a file system without direct reads
        return None
    a, b = os.fstat(fd), os.fstat(dfd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(dfd)
        return None
    return dfd


def start(fd: int, size: int, spans: list[tuple[int, int]]) -> "ReadAhead | None":
    """A :class:`ReadAhead` over ``spans`` (sorted, merged byte ranges) of the file open as ``fd``, when direct reads
    are worth it and possible there; else ``None``."""
    how = mode()
    if how == "off" or not spans:
        return None
    if how == "auto":
        if sum(b - a for a, b in spans) < MIN_BYTES:
            return None
        cached = cached_fraction(fd, size, spans)
        if cached is None or cached >= 0.5:
            return None
    dfd = _reopen(fd)
    if dfd is None:
        return None
    try:
        ahead = ReadAhead(dfd, size, spans, PIECE if how == "auto" else FORCED_PIECE)
    except (OSError, RuntimeError):  # no memory for its buffers, no thread for its reads: read plainly
        os.close(dfd)
        return None
    with _lock:
        STATS["files"] += 1
    return ahead


def _pieces(size: int, spans: list[tuple[int, int]], piece: int) -> list[tuple[int, int]]:
    """Aligned pieces of at most ``piece`` bytes covering ``spans``, in order; the last may end past the file."""
    ranges: list[list[int]] = []
    for a, b in spans:
        a, b = max(0, a), min(b, size)  # within the file, whatever the ranges claim
        if b <= a:
            continue
        lo, hi = a // ALIGN * ALIGN, -(-b // ALIGN) * ALIGN
        if ranges and lo <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], hi)
        else:
            ranges.append([lo, hi])
    return [(s, min(s + piece, hi)) for lo, hi in ranges for s in range(lo, hi, piece)]


class ReadAhead:
    """The direct reads of one file's advised ranges, :data:`DEPTH` in flight, consumed in order by :meth:`serve`."""

    def __init__(self, dfd: int, size: int, spans: list[tuple[int, int]], piece: int = PIECE) -> None:
        self.dfd, self.size = dfd, size
        self.pieces = _pieces(size, spans, piece)
        self.starts = [s for s, _ in self.pieces]
        self.bufs = _buffers(min(DEPTH, len(self.pieces)), piece)
        # its own threads, joined when the file is closed: nothing of a restore's is left running after it
        self.pool = ThreadPoolExecutor(max(1, len(self.bufs)), thread_name_prefix="ckptio-direct-read")
        self.futures: dict[int, Future[int]] = {}
        self.first = 0  # the oldest piece still held
        self.broken = False
        self.lock = threading.Lock()
        for k in range(len(self.bufs)):
            self._submit(k)

    def _submit(self, k: int) -> None:
        if k < len(self.pieces):
            start, end = self.pieces[k]
            buf = self.bufs[k % len(self.bufs)]
            self.futures[k] = self.pool.submit(os.preadv, self.dfd, [memoryview(buf)[:end - start]], start)

    def _ready(self, k: int) -> bool:
        """Whether piece ``k`` was read whole, once its read ends (if not, no more direct reads are made)."""
        start, end = self.pieces[k]
        try:
            got = self.futures[k].result()
        except (OSError, OverflowError, ValueError):  # read plainly, which names the file and what is wrong
            got = -1
        self.broken = self.broken or got < min(end, self.size) - start
        return not self.broken

    def _slide(self, k: int) -> None:
        """Move the window so that it holds piece ``k``: older pieces are let go and their buffers read ahead."""
        while k >= self.first + len(self.bufs):
            self.futures[self.first].exception()  # its read must end before the buffer is reused
            del self.futures[self.first]
            self.first += 1
            self._submit(self.first + len(self.bufs) - 1)

    def serve(self, view: memoryview, offset: int) -> bool:
        """Copy ``view.nbytes`` bytes at ``offset`` into ``view`` from the pieces read, when they hold all of them;
        ``False``: the caller reads them plainly."""
        n = view.nbytes
        if n == 0 or view.readonly or not self.pieces:
            return False
        with self.lock:
            k = bisect.bisect_right(self.starts, offset) - 1
            last = bisect.bisect_right(self.starts, offset + n - 1) - 1
            if self.broken or k < self.first or offset + n > self.pieces[last][1]:
                return False
            if any(self.pieces[j][1] != self.pieces[j + 1][0] for j in range(k, last)):
                return False  # a gap between advised ranges
            if last >= self.first + len(self.bufs) and n <= SMALL:
                return False
            dst = ctypes.addressof(ctypes.c_char.from_buffer(view))
            for j in range(k, last + 1):
                self._slide(j)
                if not self._ready(j):
                    return False
                lo, hi = max(offset, self.pieces[j][0]), min(offset + n, self.pieces[j][1])
                src = ctypes.addressof(ctypes.c_char.from_buffer(self.bufs[j % len(self.bufs)]))
                ctypes.memmove(dst + lo - offset, src + lo - self.pieces[j][0], hi - lo)  # releases the GIL
        with _lock:
            STATS["bytes"] += n
        return True

    def close(self) -> None:
        with self.lock:
            for f in self.futures.values():
                f.exception()  # every read ends before its buffer goes back
            self.futures.clear()
            self.pool.shutdown(wait=True)
            os.close(self.dfd)
            _give_back(self.bufs)
            self.bufs = []


class NegativeSeek(OSError, ValueError):
    """A seek before the start of a file: what a probing reader expects (an ``OSError``), and, when an offset the file
    itself claims leads there, bad input that the gate's :class:`~ckptio.storage.parse.parsing` names (a
    ``ValueError``)."""


class _Handle(Protocol):
    path: Any
    size: int

    def readinto(self, buf: Any, offset: int, *, settle: bool = True) -> None: ...


class HandleStream(io.RawIOBase):
    """File-like view of a :class:`ReadHandle` (its own position; reads go through the handle)."""

    def __init__(self, handle: _Handle) -> None:
        super().__init__()
        self.handle = handle
        self.pos = 0
        self.name = str(handle.path)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.handle.size}[whence]
        if base + offset < 0:  # as a file does: zipfile, probing for its end record, expects OSError; a ValueError
            raise NegativeSeek(errno.EINVAL, f"{self.name}: negative seek position")  # too: an offset a file claims
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(view.nbytes, self.handle.size - self.pos))
        if n:
            self.handle.readinto(view[:n], self.pos)
            self.pos += n
        return n

    def close(self) -> None:  # the handle is closed by its owner
        super().close()
