"""File checksums, computed while bytes are written (CRC-32C: hardware-accelerated, ~5.5 GB/s here).

Measured on this machine (256 MiB buffer, median of 3): crc32c 5.55 GB/s, zlib.crc32 1.88 GB/s, against
a disk that writes 0.2–1 GB/s durably; so checksumming on the write path costs a few percent at most.
"""

from __future__ import annotations

import errno
import io
from pathlib import Path
from typing import Any

from crc32c import crc32c

ALGORITHM = "crc32c"
_CHUNK = 8 * 1024 * 1024


def format_digest(value: int) -> str:
    """A CRC-32C value as manifests record it (``crc32c:1a2b3c4d``)."""
    return f"{ALGORITHM}:{value:08x}"


class RunningChecksum:
    """The CRC-32C of a stream of bytes, updated chunk by chunk, and its length."""

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.value = crc32c(view, self.value)
        self.size += view.nbytes

    @property
    def digest(self) -> str:
        return format_digest(self.value)


_POLY = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected


def _multmodp(a: int, b: int) -> int:
    """``a`` times ``b`` modulo the CRC polynomial (bit-reflected, as the CRC registers are)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..66, for lengths up to 2^64 bytes: cycling a table of 32
for _ in range(66):  # would be wrong from 2^29 bytes on, since x^(2^32) is not x modulo CRC-32C's polynomial
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from the CRC-32C of ``A``, that of ``B`` and ``B``'s length (as zlib's
    ``crc32_combine`` does for CRC-32): ``crc1`` shifted over ``len2`` zero bytes, plus ``crc2``."""
    if len2 <= 0:
        return crc1
    shift, k, n = 1 << 31, 3, len2  # x^(8 * len2): one factor x^(2^k) per set bit of len2, starting at x^8
    while n:
        if n & 1:
            shift = _multmodp(_X2N[k], shift)
        n >>= 1
        k += 1
    return _multmodp(shift, crc1) ^ crc2


class SpanChecksums:
    """The CRC-32Cs of bytes written from offset ``start`` of a file on, cut where the file's multiples of ``span`` fall
    (an S3 upload's parts: each goes with its own CRC-32C): :attr:`pieces`, in order, the first and the last possibly
    short. ``span`` ``None``: one piece. Every byte's CRC is computed once."""

    def __init__(self, span: int | None, start: int = 0) -> None:
        self.span, self.pos = span, start
        self.pieces = [RunningChecksum()]

    @classmethod
    def adopted(cls, span: int, values: list[int], size: int) -> "SpanChecksums":
        """The spans of a file of ``size`` bytes from ``start`` 0 whose CRC-32Cs, each span's, are ``values``."""
        made = cls(span)
        made.pieces = []
        for i, value in enumerate(values):
            piece = RunningChecksum()
            piece.value, piece.size = value, min(span, size - i * span)
            made.pieces.append(piece)
        made.pieces = made.pieces or [RunningChecksum()]
        made.pos = size
        return made

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        at = 0
        while at < view.nbytes:
            n = view.nbytes - at if self.span is None else min(view.nbytes - at, self.span - self.pos % self.span)
            if self.span is not None and self.pos % self.span == 0 and self.pieces[-1].size:
                self.pieces.append(RunningChecksum())  # a span begins
            self.pieces[-1].update(view[at:at + n])
            at += n
            self.pos += n

    def whole(self) -> list[int]:
        """The CRC-32C of each whole span so far (from ``start`` 0)."""
        return [p.value for p in self.pieces if p.size == self.span]

    def combined(self) -> int:
        """The CRC-32C of all the bytes."""
        value = 0
        for piece in self.pieces:
            value = crc32c_combine(value, piece.value, piece.size)
        return value


def bytes_checksum(data: bytes) -> str:
    """The digest of ``data`` as manifests record it."""
    return format_digest(crc32c(data))


def file_checksum(path: str | Path) -> str:
    """Checksum of a whole file, read in chunks (for verification and for small side files)."""
    running = RunningChecksum()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            running.update(view[:n])
    return running.digest


class ChecksummingStream(io.RawIOBase):
    """Wraps a binary file opened for writing; every byte written updates a running checksum.

    Only sequential writing is supported: a ``seek`` away from the end would make the running value
    wrong, so it is refused.
    """

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.checksum = RunningChecksum()
        self.error: OSError | None = None
        """The first OSError a write raised: callers such as torch's zip writer may swallow it."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = self.write_unsummed(view)
        self.checksum.update(view)
        return done

    def write_unsummed(self, view: memoryview) -> int:
        """Write ``view`` whole, leaving the running checksum to the caller (one that computes the CRC-32C of the
        same bytes in pieces of its own, e.g. an upload's parts, and sets :attr:`checksum` from them)."""
        # Write everything or raise: a short write (a full disk, a file-size limit) is retried, which
        # surfaces the real OSError (ENOSPC, EFBIG) instead of a count callers may not check.
        done = 0
        while done < view.nbytes:
            try:
                n = self.raw.write(view[done:])
            except OSError as exc:
                named = exc
                if exc.filename is None and exc.errno is not None and hasattr(self.raw, "name"):
                    named = OSError(exc.errno, exc.strerror, str(self.raw.name))  # say which file
                self.error = self.error or named
                if named is exc:
                    raise
                raise named from exc
            if not n:
                raise OSError(errno.EIO, f"write to {getattr(self.raw, 'name', 'file')} made no progress")
            done += n
        return done

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        if (whence, offset) in ((1, 0), (2, 0)) or (whence == 0 and offset == self.raw.tell()):
            return self.raw.seek(offset, whence)
        raise io.UnsupportedOperation("a checksumming stream is write-once and sequential")

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()
