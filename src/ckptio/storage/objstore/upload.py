"""A new object uploaded from memory as it is written (GCS, Azure): no local spool.

The bytes a writer hands over are copied into a part buffer (taken from a small pool, so its pages are touched once
per process, not once per part); a full part gets its CRC-32C (the hardware CRC, ~0.06 CPU-s/GB here) and goes to
the bucket's :class:`Parts` on a thread while the writer fills the next one. Only
``threads`` parts are ever in flight, so a file of any size holds at most ``threads + 1`` parts in memory (the
first may be larger, :attr:`Parts.first_size`). The
object's checksum is the running CRC-32C of those part buffers: of the very bytes handed to the client, which is
what the manifest records and the store checks where it can (GCS: the object's CRC-32C it answers with).
:meth:`PartStream.close` sends the last part and finishes the object; an object that stayed within one part goes
up in one request (:meth:`Parts.single`).
"""

from __future__ import annotations

import io
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from crc32c import crc32c

from ..base import ClosedOnSuccess
from ..checksum import crc32c_combine, format_digest

POOLED = 4
"""Part buffers of each size kept for reuse once their upload is done (the rest are freed)..."""
POOL_BYTES = 256 << 20
"""... and no more than these bytes of them (two of GCS's 100 MiB parts: what one file holds at once)."""
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


class Parts(ABC):
    """How one bucket uploads an object part by part (one object; :meth:`send` is called in order, on a thread of
    the stream's pool, at most ``threads`` at once)."""

    part_size: int
    first_size: int = 0
    """Bytes of an object's first part, when more than :attr:`part_size`: an object within it goes up in one request
    (:meth:`single`), a larger one's first part as one request, the rest in parts of :attr:`part_size` (Azure's: the
    client's single-put size; every request costs the client's pipeline CPU, ~1.6 ms)."""
    threads: int = 1
    """Parts sent at once (1: a store that takes the parts of an object in order only, such as GCS's resumable
    upload)."""

    @abstractmethod
    def send(self, number: int, offset: int, data: memoryview, crc: int) -> None:
        """Upload part ``number`` (from 0): ``data``, the object's bytes from ``offset``, whose CRC-32C is ``crc``;
        a transient failure is retried here."""

    @abstractmethod
    def finish(self, number: int, offset: int, data: memoryview, crc: int, size: int, total_crc: int) -> None:
        """Upload the last part (``data``, possibly empty; every earlier part was sent) and make the object of
        ``size`` bytes whose CRC-32C is ``total_crc``; the store's own checksum of it must agree."""

    @abstractmethod
    def single(self, data: memoryview, crc: int) -> None:
        """Upload the whole object, ``data`` (within one part), in one request; checked as :meth:`finish` is."""

    def abort(self) -> None:
        """Drop what was sent of an object that will not be finished (best effort)."""


class PartStream(ClosedOnSuccess):
    """A :class:`~ckptio.storage.base.WriteStream` that becomes an object as its parts are uploaded (see the
    module); :meth:`close` returns its digest once the object is made."""

    def __init__(self, parts: Parts, where: object) -> None:
        self.parts, self.where = parts, where
        self.error: OSError | None = None
        self._buf: bytearray | None = None
        self._fill = 0
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

    def write(self, data: Any) -> int:
        if self._digest is not None:
            raise ValueError(f"{self.where}: write to a closed stream")
        view = memoryview(data).cast("B")
        done = 0
        while done < view.nbytes:
            if self._buf is not None and self._fill == len(self._buf):
                self._send_full()  # a full part goes once more bytes come (one the file ends with goes at close)
            if self._buf is None:
                self._buf = _take(self.parts.part_size if self._number else
                                  max(self.parts.first_size, self.parts.part_size))
            size = len(self._buf)
            n = min(size - self._fill, view.nbytes - done)
            with memoryview(self._buf) as into:  # straight into the part (a bytearray's own slice assignment from
                into[self._fill:self._fill + n] = view[done:done + n]  # a memoryview copies the piece first)
            self._fill += n
            done += n
        return done

    def _send_full(self) -> None:
        buf, self._buf = self._buf, None
        assert buf is not None
        crc = crc32c(buf)
        self._value = crc32c_combine(self._value, crc, len(buf))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.parts.threads, thread_name_prefix="ckptio-upload")
        # bounded: the oldest part in flight is waited for while ``threads`` are; a failed one raises here
        while self._flight and (self._flight[0].done() or len(self._flight) >= self.parts.threads):
            self._flight.pop(0).result()
        self._flight.append(self._pool.submit(self._send_part, self._number, self._sent, buf, crc))
        self._number += 1
        self._sent += len(buf)
        self._fill = 0

    def _send_part(self, number: int, offset: int, buf: bytearray, crc: int) -> None:
        try:
            self.parts.send(number, offset, memoryview(buf), crc)
        finally:
            _give(buf)

    def close(self) -> str:
        if self._digest is not None:
            return self._digest
        buf, fill = self._buf, self._fill
        try:
            tail = memoryview(buf)[:fill] if buf is not None else memoryview(b"")
            crc = crc32c(tail)
            total = crc32c_combine(self._value, crc, fill)
            if self._number == 0:
                self.parts.single(tail, crc)
            else:
                for f in self._flight:
                    f.result()
                self.parts.finish(self._number, self._sent, tail, crc, self._sent + fill, total)
            self._value = total
        except BaseException:
            self._stop(abort=True)
            raise
        finally:
            self._buf = None
            if buf is not None:
                _give(buf)
        self._stop(abort=False)
        self._digest = format_digest(total)
        return self._digest

    @property
    def digest(self) -> str:
        if self._digest is not None:
            return self._digest
        tail = memoryview(self._buf)[:self._fill] if self._buf is not None else b""
        return format_digest(crc32c_combine(self._value, crc32c(tail), self._fill))

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.where} is uploaded from memory: no file descriptor")

    def _stop(self, *, abort: bool) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=abort)
            self._pool = None
        if abort:
            self.parts.abort()

    def discard(self) -> None:
        if self._digest is None:
            self._digest = format_digest(self._value)
            self._stop(abort=True)
            if self._buf is not None:
                _give(self._buf)
                self._buf = None
