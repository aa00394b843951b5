"""One new file written by several threads at once: consecutive regions of known lengths, each its own stream.

A DCP folder holds one data file per rank (``__R_0.distcp``, the layout other tools expect), yet one stream
per file leaves half of this machine's disk speed unused (two streams write ~1.6× faster). So the file is
cut into regions whose lengths are known before writing starts; each region is a stream that writes with
``pwrite`` at its own offset and keeps its own CRC-32C, and when the last region closes the file's checksum
is the regions' checksums combined (:func:`~ckptio.storage.checksum.crc32c_combine`) — the same value a
front-to-back write would have given — and the underlying stream is closed (fsynced, or uploaded for
object storage) as one file. A stream that names a ``crc_span`` (an S3 upload: its part size) has each region's
CRC-32C cut at the multiples of it, and is given the CRC-32C of each span (each part) besides the file's: no byte's
CRC is computed twice.

Thread safety: each :class:`Region` is used by one thread; :class:`RegionedFile` is safe to close from any.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

from .base import ClosedOnSuccess
from .checksum import RunningChecksum, SpanChecksums, crc32c_combine
from .posix import Writeback

__all__ = ["RegionedFile", "Region"]


class RegionedFile:
    """``stream`` (a new file of a :class:`~ckptio.storage.base.FolderWriter`) written as regions of ``lengths``
    bytes, in that order. :meth:`region` gives each region's stream; the file is finished when all are closed."""

    def __init__(self, stream: Any, lengths: list[int]) -> None:
        self.stream, self.lengths = stream, list(lengths)
        self.offsets = [sum(self.lengths[:i]) for i in range(len(self.lengths))]
        self.span: int | None = getattr(stream, "crc_span", None)
        """Where the regions' CRC-32Cs are cut (the multiples of it), for a stream that takes one per span."""
        self._sums: list[list[RunningChecksum] | None] = [None] * len(self.lengths)
        self._left = len(self.lengths)
        self._failed = False
        self._lock = threading.Lock()
        self.digest: str | None = None

    @property
    def name(self) -> str:
        return str(getattr(self.stream, "path", "file"))

    def region(self, i: int) -> "Region":
        return Region(self, i)

    def abandon(self) -> None:
        """Give up a file some of whose regions were never opened (the save failed): it is discarded."""
        with self._lock:
            if not self._left:
                return
            self._left, self._failed = 0, True
        self.stream.discard()

    def _finish(self, i: int, checksum: list[RunningChecksum] | None) -> str | None:
        """Called once per region (``checksum``: its CRC-32Cs, cut at the spans; ``None``: it failed); the last one
        closes the file. Returns the file's digest to the caller that closed it, ``None`` to the others."""
        with self._lock:
            if not self._left:  # abandoned
                return None
            self._sums[i] = checksum
            self._failed |= checksum is None
            self._left -= 1
            if self._left:
                return None
        if self._failed:
            self.stream.discard()
            return None
        value, size, spans = 0, 0, []  # the file's CRC-32C; with a span, each span's
        for sums in self._sums:
            assert sums is not None  # every region closed without failing
            for piece in sums:
                if self.span is None:
                    value = crc32c_combine(value, piece.value, piece.size)
                elif piece.size and size % self.span == 0:
                    spans.append(piece.value)  # a piece that starts a span (none crosses one)
                elif piece.size:
                    spans[-1] = crc32c_combine(spans[-1], piece.value, piece.size)
                size += piece.size
        if self.span is None:
            self.stream.adopt_checksum(value, size)
        else:
            self.stream.adopt_checksum(None, size, spans=spans)
        self.digest = self.stream.close()
        return self.digest


class Region(ClosedOnSuccess):
    """The stream of one region: sequential writes from the region's start, ``tell()`` in file offsets."""

    def __init__(self, file: RegionedFile, i: int) -> None:
        self.file, self.i = file, i
        self.start, self.length = file.offsets[i], file.lengths[i]
        self.pos = self.start
        self.sums = SpanChecksums(file.span, self.start)
        """The CRC-32Cs of what is written, cut where the file's spans end."""
        self.error: OSError | None = None
        self._done = False
        writeback = getattr(file.stream, "writeback_from", None)  # a durable local file: written out as it comes
        self._writeback: Writeback | None = writeback(self.start) if writeback is not None else None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.pos + view.nbytes > self.start + self.length:
            raise OSError(errno.EIO, f"{self.file.name}: region {self.i} would grow past its planned "
                                     f"{self.length} bytes (a serialisation that did not match its dry run)")
        fd, done = self.file.stream.fileno(), 0
        while done < view.nbytes:
            try:
                n = os.pwrite(fd, view[done:], self.pos + done)
            except OSError as exc:
                named = exc if exc.filename is not None else OSError(exc.errno, exc.strerror, self.file.name)
                self.error = self.error or named
                raise named from (None if named is exc else exc)
            if not n:
                raise OSError(errno.EIO, f"write to {self.file.name} made no progress")
            done += n
        self.sums.update(view)
        self.pos += done
        if self._writeback is not None:
            self._writeback.advance(self.pos)
        return done

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.file.stream.fileno()

    def flush(self) -> None:
        """Writes go straight to the file (``pwrite``); the file is fsynced when its last region closes."""

    def close(self) -> str | None:
        """The file's digest once every region is closed (the file is then durable), else ``None``. Closing
        again returns the same (DCP closes its streams itself, inside the block that opened them)."""
        if self._done:
            return self.file.digest
        self._done = True
        if self.pos != self.start + self.length:
            self.error = self.error or OSError(errno.EIO, f"{self.file.name}: region {self.i} holds "
                                                          f"{self.pos - self.start} bytes, {self.length} were planned")
            self.file._finish(self.i, None)
            raise self.error
        return self.file._finish(self.i, self.sums.pieces)

    def discard(self) -> None:
        if not self._done:
            self._done = True
            self.file._finish(self.i, None)
