"""An fsspec filesystem for ``s3://``, ``gs://`` and ``az://`` (``abfs://``) over ckptio's own buckets
(:class:`~._store.Bucket`), for frameworks that look at folders through fsspec (Lightning's ``ModelCheckpoint``
lists, tests and times its ``dirpath`` with it).

A scheme is registered by :func:`register` only when fsspec's own filesystem for it is not installed (``s3fs``,
``gcsfs``, ``adlfs``): a user who has one keeps it. It offers what a framework needs around checkpoints: listing (a folder
ckptio is still writing, marked in progress and without its manifest, is not listed), ``info``, ``modified``, small
reads and writes through ``open`` (whole objects), deletion, and no-op directory creation. Credentials are the
backend's (the standard AWS configuration; application default credentials or ``STORAGE_EMULATOR_HOST``; Azure's
settings).
"""

from __future__ import annotations

import importlib.util
import io
from datetime import datetime, timezone
from typing import Any

from fsspec.spec import AbstractFileSystem

from ._store import MANIFEST, PENDING, Bucket

__all__ = ["CkptioS3FileSystem", "CkptioGSFileSystem", "CkptioAzureFileSystem", "register", "bucket_of"]


def bucket_of(scheme: str, name: str) -> Bucket:
    """The backend's bucket ``name`` for ``scheme`` (``s3``, ``gs``, ``az``, ``abfs``)."""
    from .. import open_storage

    return open_storage(f"{scheme}://{name}").store  # type: ignore[attr-defined,no-any-return]


class _ObjectFileSystem(AbstractFileSystem):
    """``<scheme>://bucket/key`` through ckptio's bucket of that scheme (see the module's documentation)."""

    protocol: tuple[str, ...] = ()
    root_marker = ""

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path[0] if isinstance(path, list) else path)
        for scheme in cls.protocol:
            if text.startswith(f"{scheme}://"):
                text = text[len(scheme) + 3:]
        return text.rstrip("/")

    def _split(self, path: Any) -> tuple[Bucket, str]:
        name, _, key = self._strip_protocol(path).partition("/")
        return bucket_of(self.protocol[0], name), key

    def _in_progress(self, bucket: Bucket, prefix: str) -> bool:
        return bucket.head(f"{prefix}/{PENDING}") is not None and bucket.head(f"{prefix}/{MANIFEST}") is None

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> list[Any]:
        bucket, key = self._split(path)
        prefix = f"{key}/" if key else ""
        objects, prefixes = bucket.listing(prefix, delimiter=True)
        out: list[dict[str, Any]] = [{"name": f"{bucket.name}/{sub.rstrip('/')}", "size": 0, "type": "directory"}
                                     for sub in prefixes if not self._in_progress(bucket, sub.rstrip("/"))]
        out += [{"name": f"{bucket.name}/{o.key}", "size": o.size, "type": "file", "mtime": o.mtime}
                for o in objects if o.key != prefix]
        if not out and key:
            out = [self.info(path)]  # a file, or FileNotFoundError
        return out if detail else [e["name"] for e in out]

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        bucket, key = self._split(path)
        if not key:
            return {"name": bucket.name, "size": 0, "type": "directory"}
        obj = bucket.head(key)
        if obj is not None:
            return {"name": f"{bucket.name}/{key}", "size": obj.size, "type": "file", "mtime": obj.mtime}
        objects, prefixes = bucket.listing(f"{key}/", delimiter=True)
        if (objects or prefixes) and not self._in_progress(bucket, key):
            return {"name": f"{bucket.name}/{key}", "size": 0, "type": "directory"}
        raise FileNotFoundError(f"{self.protocol[0]}://{bucket.name}/{key}")

    def modified(self, path: Any) -> datetime:
        """A file's time; a folder's is its manifest's (when it was committed), else its newest object's."""
        info = self.info(path)
        if info["type"] == "file":
            return datetime.fromtimestamp(info["mtime"], timezone.utc)
        bucket, key = self._split(path)
        manifest = bucket.head(f"{key}/{MANIFEST}")
        if manifest is not None:
            return datetime.fromtimestamp(manifest.mtime, timezone.utc)
        return datetime.fromtimestamp(max(o.mtime for o in bucket.listing(f"{key}/", delimiter=False)[0]),
                                      timezone.utc)

    def _open(self, path: Any, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        bucket, key = self._split(path)
        if "r" in mode:
            return io.BytesIO(bucket.get(key, 1 << 62)[0])
        return _Upload(bucket, key)

    def mkdir(self, path: Any, create_parents: bool = True, **kwargs: Any) -> None:
        pass  # no directories in an object store: a folder exists once an object is under it

    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        pass

    def rmdir(self, path: Any) -> None:
        pass

    def rm_file(self, path: Any) -> None:
        bucket, key = self._split(path)
        bucket.delete(key)

    def _rm(self, path: Any) -> None:
        self.rm_file(path)


class CkptioS3FileSystem(_ObjectFileSystem):
    """``s3://bucket/key`` (``s3a://``) through ckptio's S3 client."""

    protocol = ("s3", "s3a")


class CkptioGSFileSystem(_ObjectFileSystem):
    """``gs://bucket/key`` through ckptio's GCS client."""

    protocol = ("gs", "gcs")


class CkptioAzureFileSystem(_ObjectFileSystem):
    """``az://container/key`` (``abfs://``) through ckptio's Azure client."""

    protocol = ("az", "abfs")

    def _split(self, path: Any) -> tuple[Bucket, str]:
        scheme = "abfs" if str(path).startswith("abfs://") else "az"
        name, _, key = self._strip_protocol(path).partition("/")
        return bucket_of(scheme, name), key


class _Upload(io.BytesIO):
    """Bytes written, put as one object when closed."""

    def __init__(self, bucket: Bucket, key: str) -> None:
        super().__init__()
        self.bucket, self.key = bucket, key

    def close(self) -> None:
        if not self.closed:
            self.bucket.put(self.key, self.getvalue())
        super().close()


OWN = {CkptioS3FileSystem: "s3fs", CkptioGSFileSystem: "gcsfs", CkptioAzureFileSystem: "adlfs"}
"""Each filesystem and fsspec's own for its schemes, which is used instead when it is installed."""


def register() -> list[str]:
    """Make ``s3://``, ``gs://`` and ``az://`` (``abfs://``) paths in fsspec use ckptio's buckets where fsspec's own
    filesystem for them (s3fs, gcsfs, adlfs) is not installed. Returns the schemes registered."""
    import fsspec

    done = []
    for fs, theirs in OWN.items():
        if importlib.util.find_spec(theirs) is None:
            for protocol in fs.protocol:
                fsspec.register_implementation(protocol, fs, clobber=True)
                done.append(protocol)
    return done
