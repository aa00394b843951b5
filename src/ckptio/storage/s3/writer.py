"""Writing to object storage: files spooled and uploaded in parts as they are written, a step committed by its
manifest."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError, CheckpointNotFoundError
from ..confined import check_relative
from ..local import LocalWriteStream
from ..lock import Scratch
from . import _common
from ._common import MANIFEST, PENDING, S3Error, S3Path, _call, client

if TYPE_CHECKING:
    from . import S3Storage
    from .reader import S3Folder

class S3WriteStream(LocalWriteStream):
    """A file spooled locally with a running CRC-32C and uploaded as it is written: once a part's worth
    (:data:`~._common.PART_SIZE`) is spooled, it goes up as a part of a multipart upload while the writer goes on;
    :meth:`close` sends the rest and completes it (a file that stayed under one part is one ``PUT`` at close)."""

    def __init__(self, spool: Path, bucket: str, key: str, where: S3Path) -> None:
        spool.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(spool, durable=False)
        self.bucket, self.key, self.where = bucket, key, where
        self._parts: _Parts | None = None

    def write(self, data: object) -> int:
        n = super().write(data)
        size = self.size
        if size - (self._parts.sent if self._parts is not None else 0) >= _common.PART_SIZE:
            # a whole part is spooled: it goes up now (only the last part of an upload may be shorter)
            self._raw.flush()
            if self._parts is None:
                self._parts = _Parts(self.path, self.bucket, self.key, self.where)
            while size - self._parts.sent >= _common.PART_SIZE:
                self._parts.send(self._parts.sent + _common.PART_SIZE)
        return n

    def close(self) -> str:
        if self._digest is not None:
            return self._digest
        digest = super().close()
        try:
            if self._parts is None:
                upload_file(self.path, self.bucket, self.key, self.where)
            else:
                self._parts.finish(self.path.stat().st_size)
        finally:
            self.path.unlink(missing_ok=True)
        return digest

    def discard(self) -> None:
        super().discard()
        if self._parts is not None:
            self._parts.abort()
        self.path.unlink(missing_ok=True)


class _Parts:
    """A multipart upload fed while its file is still being written: each part read back from the spool (the page
    cache) and sent on a pool's thread; :meth:`finish` sends the rest and completes, :meth:`abort` drops it."""

    def __init__(self, path: Path, bucket: str, key: str, where: object) -> None:
        self.path, self.bucket, self.key, self.where = path, bucket, key, where
        self.upload = _call("starting the upload of", where, client().create_multipart_upload, Bucket=bucket,
                            Key=key)["UploadId"]
        self.pool = ThreadPoolExecutor(_common.UPLOAD_THREADS, thread_name_prefix="ckptio-s3-upload")
        self.futures: list[Any] = []
        self.sent = 0

    def send(self, end: int) -> None:
        """Send the bytes from where the last part ended to ``end`` as the next part (in the background)."""
        self.futures.append(self.pool.submit(_upload_part, self.path, self.bucket, self.key, self.where, self.upload,
                                             len(self.futures) + 1, self.sent, end - self.sent))
        self.sent = end

    def finish(self, size: int, **extra: Any) -> None:
        """Send the rest of the file's ``size`` bytes and complete the upload (``extra``: e.g. ``IfNoneMatch``)."""
        try:
            while self.sent < size:
                self.send(min(size, self.sent + _common.PART_SIZE))
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


def _upload_part(path: Path, bucket: str, key: str, where: object, upload: str, number: int, offset: int,
                 length: int) -> dict[str, Any]:
    """One part of a multipart upload, read from ``path`` at ``offset``."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read(length)
    if len(data) != length:
        raise CheckpointError(f"{where}: its spool file {path} is shorter than written ({offset + len(data)} bytes)")
    etag = _call(f"uploading part {number} of", where, client().upload_part, Bucket=bucket, Key=key, UploadId=upload,
                 PartNumber=number, Body=data)["ETag"]
    return {"PartNumber": number, "ETag": etag}


def upload_file(path: Path, bucket: str, key: str, where: object, *, if_none_match: bool = False) -> None:
    """Upload a local file: one ``PUT`` up to :data:`PART_SIZE`, else parts in parallel (aborted on failure)."""
    s3 = client()
    size = path.stat().st_size
    extra = {"IfNoneMatch": "*"} if if_none_match else {}
    if size <= _common.PART_SIZE:
        with open(path, "rb") as fh:
            _call("uploading", where, s3.put_object, Bucket=bucket, Key=key, Body=fh, **extra)
        return
    _Parts(path, bucket, key, where).finish(size, **extra)


class S3FolderWriter:
    """A step (or any new folder) written object by object; committed by its manifest, written last."""

    def __init__(self, storage: "S3Storage", name: str) -> None:
        self.storage, self.name, self.token = storage, name, name
        self.prefix = storage._key(name)
        # ranks other than the committing one never call commit/abort: their spool goes with the writer; a killed
        # process's is removed by the next process that spools (ckptio.storage.scratch)
        self._scratch = Scratch(f"ckptio-s3-{name}-")
        self.spool = self._scratch.path
        self._local = self.spool / "local"
        self._local_sums: dict[str, str] = {}

    def _where(self, rel: str) -> S3Path:
        return self.storage.root / self.name / rel  # type: ignore[return-value]

    def _key(self, rel: str) -> str:
        return "/".join((self.prefix, *check_relative(rel, self._where(""))))

    def open(self, rel: str) -> S3WriteStream:
        key = self._key(rel)
        return S3WriteStream(self.spool / "streams" / uuid.uuid4().hex, self.storage.bucket, key, self._where(rel))

    def write_bytes(self, rel: str, data: bytes) -> str:
        with self.open(rel) as stream:
            stream.write(data)
        return stream.close()

    def link(self, rel: str, source: str, size: int) -> bool:
        """A reference instead of a copy: ``True`` when ``source`` (``step/path``) is an object of ``size`` bytes in
        the folder; the step's manifest then names it for ``rel`` (``shared``; see :mod:`ckptio.storage.s3.refs`)."""
        from ... import _faults
        from .refs import check_source

        check_relative(rel, self._where(""))
        _faults.point("save.before_link")
        return check_source(self.storage, source, size)

    def local_path(self, rel: str = "") -> Path:
        """A local folder whose files are uploaded at :meth:`files`/:meth:`commit` (rank 0 writes there)."""
        path = self._local / rel if rel else self._local
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _upload_local(self) -> None:
        from ..checksum import file_checksum

        if self._local.is_dir():
            for path in sorted(self._local.rglob("*")):
                rel = path.relative_to(self._local).as_posix()
                if path.is_file() and not path.is_symlink() and rel not in self._local_sums:
                    digest = file_checksum(path)
                    upload_file(path, self.storage.bucket, self._key(rel), self._where(rel))
                    self._local_sums[rel] = digest

    def reader(self, rel: str = "") -> "S3Folder":
        """What every rank has uploaded under ``rel`` so far (this rank's local files are uploaded first)."""
        from .reader import S3Folder

        self._upload_local()
        return S3Folder(self.storage.bucket, f"{self.prefix}/{rel}" if rel else self.prefix)

    def checksum_of(self, rel: str) -> str:
        self._upload_local()
        if rel not in self._local_sums:
            raise CheckpointError(f"{self._where(rel)}: written by another writer, its checksum is not known here")
        return self._local_sums[rel]

    def rename(self, rel: str, new_rel: str) -> None:
        s3 = client()
        src, dst = self._key(rel), self._key(new_rel)
        _call("copying", self._where(rel), s3.copy_object, Bucket=self.storage.bucket, Key=dst,
              CopySource={"Bucket": self.storage.bucket, "Key": src})
        _call("removing", self._where(rel), s3.delete_object, Bucket=self.storage.bucket, Key=src)

    def exists(self, rel: str) -> bool:
        try:
            _call("looking up", self._where(rel), client().head_object, Bucket=self.storage.bucket, Key=self._key(rel))
        except CheckpointNotFoundError:
            return False
        return True

    def files(self) -> dict[str, int]:
        """Every object written so far under this step, by every rank (files of :meth:`local_path` uploaded first)."""
        self._upload_local()
        return {rel: int(obj["Size"]) for rel, obj in self.storage._objects(self.prefix).items()
                if rel not in (MANIFEST, PENDING)}

    def mark_pending(self) -> None:
        """Write the step's in-progress mark (before any of its files; see :data:`ckptio.engine.manifest.PENDING_NAME`)."""
        _call("writing", self._where(PENDING), client().put_object, Bucket=self.storage.bucket,
              Key=self._key(PENDING), Body=b"")

    def commit(self, manifest: tuple[str, bytes] | None = None) -> S3Path:
        self._upload_local()
        if manifest is not None:
            from ... import _faults

            _faults.point("commit.before_manifest")
            name, data = manifest
            path = self.spool / "manifest"
            path.write_bytes(data)
            try:
                upload_file(path, self.storage.bucket, self._key(name), self._where(name), if_none_match=True)
            except S3Error as exc:
                if "PreconditionFailed" in str(exc) or "ConditionalRequestConflict" in str(exc):
                    raise CheckpointError(f"{self._where('')}: another writer committed this step first; this save "
                                          "is not committed (two jobs must not share a checkpoint_dir)") from None
                raise
            try:  # committed: the mark goes (a leftover one is harmless, the manifest decides)
                client().delete_object(Bucket=self.storage.bucket, Key=self._key(PENDING))
            except Exception:  # noqa: BLE001
                pass
        self._scratch.remove()
        return self._where("").parent / self.name  # type: ignore[return-value]

    def abort(self) -> None:
        self._scratch.remove()
        self.storage._delete_prefix(self.prefix, manifest_first=True)

    def abort_spool(self) -> None:
        """Drop the local spool only: objects already uploaded stay (adding files to a committed step)."""
        self._scratch.remove()


