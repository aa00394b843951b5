"""Writing to S3: files spooled and uploaded in parts as they are written (the folder writer, which commits a step by
its manifest, is the object store's: :mod:`ckptio.storage.objstore.writer`)."""

from __future__ import annotations

import base64
import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from crc32c import crc32c

from ...errors import CheckpointError
from ..checksum import SpanChecksums, format_digest
from ..local import LocalWriteStream
from ..objstore.writer import ObjectFolderWriter
from . import _common
from ._common import S3Path, _call, client

__all__ = ["S3WriteStream", "S3FolderWriter", "upload_file"]

class S3WriteStream(LocalWriteStream):
    """A file spooled locally and uploaded as it is written: once a part's worth (:data:`~._common.PART_SIZE`) is
    spooled, it goes up as a part of a multipart upload while the writer goes on; :meth:`close` sends the rest and
    completes it (a file that stayed under one part is one ``PUT`` at close).

    Each part's CRC-32C is computed as its bytes are written (the file's is combined from the parts'): every byte's
    CRC is computed once, and the spool is read once, to send the part, which the server checks against that CRC,
    so a part whose spooled bytes are not the ones written is refused. A file written as regions
    (:mod:`~ckptio.storage.regions`) has its regions' CRCs cut at the parts (:attr:`crc_span`)."""

    def __init__(self, spool: Path, bucket: str, key: str, where: S3Path) -> None:
        spool.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(spool, durable=False)
        self.bucket, self.key, self.where = bucket, key, where
        self.crc_span = _common.PART_SIZE
        """The part size: the CRC-32C of each part's bytes is what goes with the part."""
        self._parts: _Parts | None = None
        self._sums: SpanChecksums | None = SpanChecksums(self.crc_span)
        """Each part's CRC-32C (``None``: the file's adopted whole, each part's read back to send)."""

    @property
    def size(self) -> int:
        return self._out.checksum.size if self._sums is None else self._sums.pos

    @property
    def digest(self) -> str:
        return self._out.checksum.digest if self._sums is None else format_digest(self._sums.combined())

    def write(self, data: object) -> int:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        assert self._sums is not None, "a stream whose checksum was adopted is written no more"
        done = self._out.write_unsummed(view)
        self._sums.update(view)
        whole = self._sums.whole()
        if len(whole) > (len(self._parts.futures) if self._parts is not None else 0):
            # a whole part is spooled: it goes up now (only the last part of an upload may be shorter)
            self._raw.flush()
            if self._parts is None:
                self._parts = _Parts(self.path, self.bucket, self.key, self.where, self.crc_span)
            while len(self._parts.futures) < len(whole):
                self._parts.send(self._parts.sent + self.crc_span, whole[len(self._parts.futures)])
        return done

    def adopt_checksum(self, value: int | None, size: int, spans: list[int] | None = None) -> None:
        """Take the CRC-32C of content written past this stream (in regions): the file's, or each part's
        (``spans``, cut at :attr:`crc_span`), from which the file's is combined."""
        if spans is None:
            assert value is not None
            super().adopt_checksum(value, size)
            self._sums = None
            return
        self._sums = SpanChecksums.adopted(self.crc_span, spans, size)

    def close(self) -> str:
        if self._digest is not None:
            return self._digest
        digest = super().close()
        try:
            size = self.path.stat().st_size
            if size != self.size:
                if self._parts is not None:
                    self._parts.abort()
                raise CheckpointError(f"{self.where}: its spool file {self.path} holds {size} bytes, "
                                      f"{self.size} were written")
            crcs = None if self._sums is None else [p.value for p in self._sums.pieces if p.size]
            if self._parts is None and size <= self.crc_span:  # the CRC-32C of the write pass goes along
                upload_file(self.path, self.bucket, self.key, self.where,
                            crc=self._out.checksum.value if crcs is None else crcs[0] if crcs else 0)
            else:
                parts = self._parts or _Parts(self.path, self.bucket, self.key, self.where, self.crc_span)
                parts.finish(size, crcs=crcs)
        finally:
            self.path.unlink(missing_ok=True)
        return digest

    def discard(self) -> None:
        super().discard()
        if self._parts is not None:
            self._parts.abort()
        self.path.unlink(missing_ok=True)


def _b64(crc: int) -> str:
    """A CRC-32C as S3's ``x-amz-checksum-crc32c`` carries it (base64 of its 4 big-endian bytes)."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class _Parts:
    """A multipart upload fed while its file is still being written: each part read back from the spool (the page
    cache) and sent on a pool's thread with its CRC-32C (the server checks it; the one computed as the part was
    written, else computed from the spool); :meth:`finish` sends the rest and completes, :meth:`abort` drops it."""

    def __init__(self, path: Path, bucket: str, key: str, where: object, part_size: int) -> None:
        self.path, self.bucket, self.key, self.where, self.part_size = path, bucket, key, where, part_size
        self.upload = _call("starting the upload of", where, client().create_multipart_upload, Bucket=bucket,
                            Key=key, ChecksumAlgorithm="CRC32C")["UploadId"]
        self.pool = ThreadPoolExecutor(_common.UPLOAD_THREADS, thread_name_prefix="ckptio-s3-upload")
        self.futures: list[Any] = []
        self.sent = 0

    def send(self, end: int, crc: int | None = None) -> None:
        """Send the bytes from where the last part ended to ``end`` as the next part (in the background), with
        their CRC-32C ``crc`` (``None``: computed from the spool)."""
        self.futures.append(self.pool.submit(_upload_part, self.path, self.bucket, self.key, self.where, self.upload,
                                             len(self.futures) + 1, self.sent, end - self.sent, crc))
        self.sent = end

    def finish(self, size: int, crcs: list[int] | None = None, **extra: Any) -> None:
        """Send the rest of the file's ``size`` bytes and complete the upload (``crcs``: every part's CRC-32C, when
        known; ``extra``: e.g. ``IfNoneMatch``)."""
        try:
            while self.sent < size:
                self.send(min(size, self.sent + self.part_size), crcs[len(self.futures)] if crcs else None)
            parts = [f.result() for f in self.futures]
            _call("completing the upload of", self.where, client().complete_multipart_upload, Bucket=self.bucket,
                  Key=self.key, UploadId=self.upload, MultipartUpload={"Parts": parts}, **extra)
        except BaseException:
            self.abort()
            raise
        finally:
            self.pool.shutdown(wait=True)

    def abort(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        try:
            client().abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload)
        except Exception:  # noqa: BLE001 - the sweep aborts what is left
            pass


class _Window(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of a file, read as a file of their own: a part goes up from the spool
    in the client's small reads (reused buffers), never held whole in a fresh buffer (a 64 MiB ``read`` costs ~10x
    the CPU of the same bytes read 1 MiB at a time: every page of a new buffer faults in)."""

    def __init__(self, path: Path, offset: int, length: int) -> None:
        super().__init__()
        self._fh = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self.offset, self.length, self.pos = offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")[:max(0, self.length - self.pos)]
        done = os.preadv(self._fh.fileno(), [view], self.offset + self.pos) if view.nbytes else 0
        self.pos += done
        return done

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = min(self.length, max(0, pos + (0, self.pos, self.length)[whence]))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def close(self) -> None:
        self._fh.close()
        super().close()

    def crc(self, where: object) -> str:
        """The CRC-32C of the window, as S3 takes it (read 1 MiB at a time); the window is rewound."""
        buf = bytearray(1 << 20)
        value, self.pos = 0, 0
        while n := self.readinto(buf):
            value = crc32c(memoryview(buf)[:n], value)
        if self.pos != self.length:
            raise CheckpointError(f"{where}: its spool file {self._fh.name} is shorter than written "
                                  f"({self.offset + self.pos} bytes)")
        self.pos = 0
        return _b64(value)


def _upload_part(path: Path, bucket: str, key: str, where: object, upload: str, number: int, offset: int,
                 length: int, value: int | None) -> dict[str, Any]:
    """One part of a multipart upload, read from ``path`` at ``offset``, sent with its CRC-32C ``value`` (computed
    as it was written; ``None``: read from the spool here, hardware, ~14 GB/s): boto3 would otherwise compute a
    CRC-32 of every part itself (zlib's, ~3.5x the CPU)."""
    with _Window(path, offset, length) as body:
        crc = body.crc(where) if value is None else _b64(value)
        etag = _call(f"uploading part {number} of", where, client().upload_part, Bucket=bucket, Key=key,
                     UploadId=upload, PartNumber=number, Body=body, ContentLength=length, ChecksumCRC32C=crc)["ETag"]
    return {"PartNumber": number, "ETag": etag, "ChecksumCRC32C": crc}


def upload_file(path: Path, bucket: str, key: str, where: object, *, if_none_match: bool = False,
                crc: int | None = None) -> None:
    """Upload a local file: one ``PUT`` up to :data:`PART_SIZE`, else parts in parallel (aborted on failure). Every
    request carries the CRC-32C of its bytes, which the server checks (``crc``: the file's, when the caller computed
    it while writing; else it is computed here)."""
    s3 = client()
    size = path.stat().st_size
    extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_none_match else {}
    if size <= _common.PART_SIZE:
        with _Window(path, 0, size) as body:
            _call("uploading", where, s3.put_object, Bucket=bucket, Key=key, Body=body, ContentLength=size,
                  ChecksumAlgorithm="CRC32C", ChecksumCRC32C=body.crc(where) if crc is None else _b64(crc), **extra)
        return
    _Parts(path, bucket, key, where, _common.PART_SIZE).finish(size, **extra)


S3FolderWriter = ObjectFolderWriter
"""A step written to S3 (the object-store writer; see :class:`~ckptio.storage.objstore.writer.ObjectFolderWriter`)."""
