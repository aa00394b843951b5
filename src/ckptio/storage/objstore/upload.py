"""A new object uploaded from memory as it is written (GCS, Azure): no local spool.

A part of the object is a list of pieces of memory, sent one after another as one request's body (:class:`Body`,
never joined). The bytes of :meth:`PartStream.write` are copied into the part's buffer (taken from a small pool, so
its pages are touched once per process, not once per part). The bytes of :meth:`PartStream.write_held`, which the
caller promises not to change until the stream is closed (DCP's writer hands over the tensors' own storage), are a
piece by reference, sliced where a part ends: a save's tensor data is not copied before it is sent (the copy cost
~4.6 ms of CPU per 64 MB, per rank). A full part gets its CRC-32C over its pieces (the hardware CRC, ~0.06 CPU-s/GB
here) as it is handed to the bucket's :class:`Parts`, on a thread, while the writer fills the next one. Only
``threads`` parts are ever in flight, so a file of any size holds at most ``threads + 1`` parts' buffers in memory
(the first part may be larger, :attr:`Parts.first_size`), and a held piece is let go once its part is sent. The
object's checksum is the running CRC-32C of those parts: of the very bytes handed to the client, which is what the
manifest records and the store checks where it can (GCS: the object's CRC-32C it answers with).
:meth:`PartStream.close` sends the last part and finishes the object; an object that stayed within one part goes up
in one request (:meth:`Parts.single`).
"""

from __future__ import annotations

import io
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Sequence

from crc32c import crc32c

from ..base import ClosedOnSuccess
from ..checksum import crc32c_combine, format_digest

POOLED = 4
"""Part buffers of each size kept for reuse once their upload is done (the rest are freed)..."""
POOL_BYTES = 256 << 20
"""... and no more than these bytes of them (two of GCS's 100 MiB parts: what one file holds at once)."""
HELD = 256 << 10
"""A held write (:meth:`PartStream.write_held`) of fewer bytes is copied as a write is: a piece costs its own send
(a system call) and Python calls on the way; a copy of this many bytes costs about as much."""
_pool: dict[int, list[bytearray]] = {}
_pool_lock = threading.Lock()


def _take(size: int) -> bytearray:
    with _pool_lock:
        free = _pool.get(size)
        if free:
            return free.pop()
    return bytearray(size)


def _give(buf: bytearray) -> None:
    with _pool_lock:
        free = _pool.setdefault(len(buf), [])
        if len(free) < POOLED and (len(free) + 1) * len(buf) <= POOL_BYTES:
            free.append(buf)


def nbytes(pieces: Sequence[Any]) -> int:
    """The bytes of the pieces in all."""
    return sum(memoryview(p).nbytes for p in pieces)


def checksum(pieces: Sequence[Any]) -> int:
    """The CRC-32C of the pieces' bytes, one after another."""
    value = 0
    for piece in pieces:
        value = crc32c(piece, value)
    return value


def after(pieces: Sequence[Any], skip: int) -> list[memoryview]:
    """The pieces' bytes from byte ``skip`` on (the first piece left sliced; nothing copied)."""
    rest = []
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if skip >= view.nbytes:
            skip -= view.nbytes
            continue
        rest.append(view[skip:] if skip else view)
        skip = 0
    return rest


class Body:
    """A request body sent piece by piece from the pieces' own memory, with no joined copy: ``requests`` sends an
    iterable that has a length as it is, with that ``Content-Length`` (urllib3 hands each piece to the socket), and
    so does azure-core's requests transport (its ``HttpRequest`` passes an iterable body through unchanged). A retry
    iterates it again from its start."""

    def __init__(self, pieces: Sequence[Any]) -> None:
        self.pieces = tuple(pieces)
        self.size = nbytes(self.pieces)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Any]:
        return iter(self.pieces)


class Parts(ABC):
    """How one bucket uploads an object part by part (one object; :meth:`send` is called in order, on a thread of
    the stream's pool, at most ``threads`` at once). A part is given as its ``pieces``, memoryviews sent one after
    another, unchanged until the call returns."""

    part_size: int
    first_size: int = 0
    """Bytes of an object's first part, when more than :attr:`part_size`: an object within it goes up in one request
    (:meth:`single`), a larger one's first part as one request, the rest in parts of :attr:`part_size` (Azure's: the
    client's single-put size; every request costs the client's pipeline CPU, ~1.6 ms)."""
    threads: int = 1
    """Parts sent at once (1: a store that takes the parts of an object in order only, such as GCS's resumable
    upload)."""

    @abstractmethod
    def send(self, number: int, offset: int, pieces: Sequence[memoryview], crc: int) -> None:
        """Upload part ``number`` (from 0): ``pieces``, the object's bytes from ``offset``, whose CRC-32C is ``crc``;
        a transient failure is retried here."""

    @abstractmethod
    def finish(self, number: int, offset: int, pieces: Sequence[memoryview], crc: int, size: int,
               total_crc: int) -> None:
        """Upload the last part (``pieces``, possibly none; every earlier part was sent) and make the object of
        ``size`` bytes whose CRC-32C is ``total_crc``; the store's own checksum of it must agree."""

    @abstractmethod
    def single(self, pieces: Sequence[memoryview], crc: int) -> None:
        """Upload the whole object, ``pieces`` (within one part), in one request; checked as :meth:`finish` is."""

    def abort(self) -> None:
        """Drop what was sent of an object that will not be finished (best effort)."""


class PartStream(ClosedOnSuccess):
    """A :class:`~ckptio.storage.base.WriteStream` that becomes an object as its parts are uploaded (see the
    module); :meth:`close` returns its digest once the object is made."""

    def __init__(self, parts: Parts, where: object) -> None:
        self.parts, self.where = parts, where
        self.error: OSError | None = None
        self._pieces: list[memoryview] = []  # the current part's pieces, but for the buffer's open region
        self._buf: bytearray | None = None  # the current part's buffer (the bytes of write)
        self._start = 0  # where in it the open region (bytes written since the last held piece) starts
        self._used = 0  # and ends
        self._fill = 0  # bytes of the current part
        self._sent = 0  # bytes of earlier parts
        self._number = 0
        self._value = 0  # the CRC-32C of the parts sent so far
        self._pool: ThreadPoolExecutor | None = None
        self._flight: list[Future] = []
        self._digest: str | None = None

    @property
    def size(self) -> int:
        return self._sent + self._fill

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        """Nothing to do: a part goes up once it is full and more bytes come, the rest at :meth:`close`."""

    def _room(self) -> int:
        """Bytes the current part takes in all (the first may be larger)."""
        return self.parts.part_size if self._number else max(self.parts.first_size, self.parts.part_size)

    def _view(self, data: Any) -> memoryview:
        if self._digest is not None:
            raise ValueError(f"{self.where}: write to a closed stream")
        return memoryview(data).cast("B")

    def write(self, data: Any) -> int:
        view = self._view(data)
        done = 0
        while done < view.nbytes:
            if self._fill == self._room():
                self._send_full()  # a full part goes once more bytes come (one the file ends with goes at close)
            if self._buf is None:
                self._buf = _take(self._room())
            n = min(self._room() - self._fill, view.nbytes - done)
            with memoryview(self._buf) as into:  # straight into the part (a bytearray's own slice assignment from
                into[self._used:self._used + n] = view[done:done + n]  # a memoryview copies the piece first)
            self._used += n
            self._fill += n
            done += n
        return done

    def write_held(self, data: Any) -> int:
        """:meth:`write` of bytes the caller will not change (nor free) until this stream is closed or discarded:
        kept by reference as pieces of the parts (a smaller write than :data:`HELD` is copied)."""
        view = self._view(data)
        if view.nbytes < HELD:
            return self.write(view)
        done = 0
        while done < view.nbytes:
            if self._fill == self._room():
                self._send_full()
            n = min(self._room() - self._fill, view.nbytes - done)
            self._seal()
            self._pieces.append(view[done:done + n])
            self._fill += n
            done += n
        return done

    def _seal(self) -> None:
        """The buffer's open region becomes a piece (the bytes written after it start a new one)."""
        if self._used > self._start:
            assert self._buf is not None
            self._pieces.append(memoryview(self._buf)[self._start:self._used])
            self._start = self._used

    def _part(self) -> tuple[list[memoryview], bytearray | None]:
        """The current part's pieces and buffer, taken: the next bytes start a new part."""
        self._seal()
        pieces, buf = self._pieces, self._buf
        self._pieces, self._buf, self._start, self._used = [], None, 0, 0
        return pieces, buf

    def _send_full(self) -> None:
        pieces, buf = self._part()
        crc = checksum(pieces)  # of the bytes sent: a held piece is not changed until the stream is closed
        self._value = crc32c_combine(self._value, crc, self._fill)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.parts.threads, thread_name_prefix="ckptio-upload")
        # bounded: the oldest part in flight is waited for while ``threads`` are; a failed one raises here
        while self._flight and (self._flight[0].done() or len(self._flight) >= self.parts.threads):
            self._flight.pop(0).result()
        self._flight.append(self._pool.submit(self._send_part, self._number, self._sent, pieces, buf, crc))
        self._number += 1
        self._sent += self._fill
        self._fill = 0

    def _send_part(self, number: int, offset: int, pieces: list[memoryview], buf: bytearray | None,
                   crc: int) -> None:
        try:
            self.parts.send(number, offset, pieces, crc)
        finally:
            pieces.clear()
            if buf is not None:
                _give(buf)

    def close(self) -> str:
        if self._digest is not None:
            return self._digest
        fill = self._fill
        pieces, buf = self._part()
        try:
            crc = checksum(pieces)
            total = crc32c_combine(self._value, crc, fill)
            if self._number == 0:
                self.parts.single(pieces, crc)
            else:
                for f in self._flight:
                    f.result()
                self.parts.finish(self._number, self._sent, pieces, crc, self._sent + fill, total)
            self._value = total
        except BaseException:
            self._stop(abort=True)
            raise
        finally:
            pieces.clear()
            if buf is not None:
                _give(buf)
        self._stop(abort=False)
        self._digest = format_digest(total)
        return self._digest

    @property
    def digest(self) -> str:
        if self._digest is not None:
            return self._digest
        crc = checksum(self._pieces)
        if self._buf is not None:
            crc = crc32c(memoryview(self._buf)[self._start:self._used], crc)
        return format_digest(crc32c_combine(self._value, crc, self._fill))

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.where} is uploaded from memory: no file descriptor")

    def _stop(self, *, abort: bool) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=abort)  # no thread reads a held piece after this
            self._pool = None
        if abort:
            self.parts.abort()

    def discard(self) -> None:
        if self._digest is None:
            self._digest = format_digest(self._value)
            self._stop(abort=True)
            pieces, buf = self._part()
            pieces.clear()
            if buf is not None:
                _give(buf)
