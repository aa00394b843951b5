"""How the bytes of a :class:`~ckptio.storage.confined.ReadHandle` are read: as a file object
(:class:`HandleStream`); a restore's own data files brought into the page cache on a thread while it plans and
reads (:class:`Prefetch`, on by default); and, for a cold file, around the page cache with several ``O_DIRECT``
reads in flight ahead of the reader (:class:`ReadAhead`, opt-in).

**Prefetch.** A restore spends its first few hundred milliseconds on the manifest, the indexes and the plan, with the
disk idle, and then reads and works on what it read by turns. Onto as many ranks as wrote the checkpoint, each
rank reads back mostly the data files it wrote (DCP's ``__R_K.distcp``, the per-rank ``shard-R+1-…safetensors``),
so :func:`prefetch` has a thread read those files, in the order the restore reads them, into a reused scratch
buffer from the moment the restore begins: the disk works from the first millisecond and the page cache is filled
on a second core. It takes only local files less than half of which the page cache holds (``mincore``), only the
states being restored, at most half of the memory available shared by the node's ranks, and it stops when the
restore ends or fails. It hands no byte to anyone: the restore's own reads, through the read gate, decide what is
loaded and report what is wrong. ``CKPTIO_PREFETCH=0`` turns it off.

**Direct reads.** A restore reads most of its bytes in large, known ranges
(:meth:`~ckptio.storage.confined.ReadHandle.advise`). When those ranges are large and the page cache does not
hold them (a restore after a reboot, on a new node, or of a checkpoint written long ago), a plain read has the
kernel fill fresh page-cache pages and copy out of them, one read at a time: on the machines measured
(``docs/benchmarks.md``) filling the page cache cost more CPU than the disk took, and the restore's own work
waited behind it. A :class:`ReadAhead` instead keeps :data:`DEPTH` aligned reads of :data:`PIECE` bytes in
flight on threads of its own, straight from the disk into reused buffers, while the reader copies the piece it
needs out of them.

It is off unless ``CKPTIO_DIRECT_READS=1`` is set (:func:`mode`): what it reads does not stay in the page cache,
so a second restore of the same files on the same node reads the disk again. Where it is on, it is an
optimisation only, and it never decides what a read returns:

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
import contextlib
import ctypes
import errno
import io
import mmap
import os
import re
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

__all__ = ["ReadAhead", "start", "mode", "cached_fraction", "HandleStream", "NegativeSeek", "PIECE", "DEPTH",
           "MIN_BYTES", "STATS", "PROBES", "PROBE_BYTES", "Prefetch", "prefetch", "prefetch_mode", "own_files"]

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
STATS = {"files": 0, "bytes": 0, "prefetch_files": 0, "prefetched": 0}
"""Files this process began to read ahead, and bytes served from those reads; files and bytes it prefetched
(:class:`Prefetch`). For tests and benchmarks."""


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


PROBES, PROBE_BYTES = 16, 4 << 20
""":func:`cached_fraction` maps at most this many windows of this many bytes: never more for a larger (sparse) file."""


def cached_fraction(fd: int, size: int, spans: list[tuple[int, int]]) -> float | None:
    """Share of the pages of ``spans`` (byte ranges of the file open as ``fd``) in the page cache, from at most
    :data:`PROBES` windows of :data:`PROBE_BYTES` spread over them (all of them when they are that small), or
    ``None`` when the system cannot say."""
    clipped = [(max(0, a), min(b, size)) for a, b in spans if min(b, size) > max(0, a)]
    total = sum(b - a for a, b in clipped)
    if not total or _mincore() is None:
        return None
    length = min(PROBE_BYTES, -(-total // PROBES))
    windows: list[tuple[int, int]] = []
    for k in range(PROBES):
        at = k * total // PROBES
        for a, b in clipped:  # the k-th point of the ranges laid end to end, and a window from it within its range
            if at < b - a:
                windows.append((a + at, min(b, a + at + length)))
                break
            at -= b - a
    resident = pages = 0
    for start, end in dict.fromkeys(windows):
        found = _resident(fd, start, end)
        if found is None:
            return None
        resident, pages = resident + found[0], pages + found[1]
    return resident / pages if pages else None


def _mincore() -> Any:  # libc's mmap, munmap and mincore, typed
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


def _resident(fd: int, start: int, end: int) -> tuple[int, int] | None:
    """(pages in the page cache, pages) of the file's bytes [start, end), through a mapping of just them."""
    page = mmap.PAGESIZE
    lo = start // page * page
    addr = _libc.mmap(None, end - lo, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = ctypes.create_string_buffer((end - lo + page - 1) // page)
        if _libc.mincore(addr, end - lo, vec) != 0:
            return None
        states = vec.raw
        return len(states) - states.count(0), len(states)  # the low bit tells; the others are reserved (0)
    finally:
        _libc.munmap(addr, end - lo)


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


# ------------------------------------------------------------------------------------------------- prefetch
PREFETCH_CHUNK = 4 << 20  # bytes of one read of the prefetching thread, into a scratch buffer it reuses
_OWN = re.compile(r"__(?P<dcp>\d{1,6})_\d{1,6}\.distcp|shard-(?P<st>\d{5})-[A-Za-z0-9_.-]{1,200}\.safetensors")


def prefetch_mode() -> str:
    """``"auto"`` (the default: a rank's own data files that the page cache does not hold yet), ``"off"``
    (``CKPTIO_PREFETCH=0``, or direct reads on: they read around the page cache) or ``"force"``
    (``CKPTIO_PREFETCH=force``: cached or not; for tests and the fuzzer)."""
    setting = os.environ.get("CKPTIO_PREFETCH", "1").strip().lower()
    if setting in ("0", "off", "false", "no") or mode() != "off":
        return "off"
    return "force" if setting == "force" else "auto"


def own_files(folder: Any, states: list[str], rank: int, world: int) -> list[str]:
    """The data files this rank wrote in the folders ``states`` of the step ``folder`` (DCP's ``__R_K.distcp``,
    the per-rank ``shard-R+1-…safetensors``), when a folder's files were written by ``world`` ranks: a restore
    onto as many ranks reads back what each wrote. In the order given, by name within a folder."""
    out: list[str] = []
    for state in states:
        if folder.kind(state) != "dir":
            continue
        named = []
        for entry in folder.listdir(state):
            m = _OWN.fullmatch(entry.name) if entry.kind == "file" else None
            if m is not None:
                named.append((entry.name, int(m["dcp"]) if m["dcp"] is not None else int(m["st"]) - 1))
        if named and min(r for _, r in named) >= 0 and max(r for _, r in named) + 1 == world:
            out += [f"{state}/{name}" for name, r in sorted(named) if r == rank]
    return out


def _budget(local_ranks: int) -> int:
    """Bytes a rank may read ahead: half the memory available over the node's ranks (nothing evicted unread)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0
    return available // (2 * max(1, local_ranks))


class Prefetch:
    """Reads files into the page cache on a thread of its own, in order (see the module's text). A hint only: it
    hands bytes to nobody, opens files through the folder's read gate, stops at :meth:`close` (the restore's end
    or failure), and leaves any error to the restore's own reads."""

    def __init__(self, folder: Any, rels: list[str], force: bool, budget: int) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(folder, rels, force, budget),
                                        name="ckptio-prefetch", daemon=True)
        self._thread.start()

    def _run(self, folder: Any, rels: list[str], force: bool, budget: int) -> None:
        scratch = None  # allocated for the first file read: a warm restore reads none
        for rel in rels:
            try:
                with folder.open(rel) as handle:
                    cached = None if force else cached_fraction(handle.fd, handle.size, [(0, handle.size)])
                    if not force and (cached is None or cached >= 0.5):
                        continue
                    with _lock:
                        STATS["prefetch_files"] += 1
                    scratch = scratch or memoryview(bytearray(PREFETCH_CHUNK))
                    offset = 0
                    while offset < handle.size and budget > 0 and not self._stop.is_set():
                        got = os.preadv(handle.fd, [scratch[:min(PREFETCH_CHUNK, budget)]], offset)
                        if got <= 0:
                            break
                        offset, budget = offset + got, budget - got
                        with _lock:
                            STATS["prefetched"] += got
            except Exception:  # noqa: BLE001 - a hint: the restore's own read of this file reports what is wrong
                continue
            if budget <= 0 or self._stop.is_set():
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "Prefetch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prefetch(folder: Any | None, states: list[str], rank: int, world: int) -> "Prefetch | Any":
    """A :class:`Prefetch` of this rank's own data files in ``states`` of the step ``folder`` (a local folder,
    restored onto as many ranks as wrote it; ``None`` for one in object storage), or a context that does nothing."""
    how = prefetch_mode()
    rels = own_files(folder, states, rank, world) if how != "off" and folder is not None else []
    budget = _budget(int(os.environ.get("LOCAL_WORLD_SIZE") or world)) if rels else 0
    return Prefetch(folder, rels, how == "force", budget) if budget > 0 else contextlib.nullcontext()
