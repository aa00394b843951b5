"""An fsspec filesystem for ``s3://`` over ckptio's own S3 client, for frameworks that look at folders through
fsspec (Lightning's ``ModelCheckpoint`` lists, tests and times its ``dirpath`` with it).

It is registered by :func:`register` only when ``s3fs`` (fsspec's own S3 filesystem) is not installed: a user who
has s3fs keeps it. It offers what a framework needs around checkpoints, not a general-purpose S3 filesystem:
listing (a folder ckptio is still writing, marked in progress and without its manifest, is not listed), ``info``,
``modified``, small reads and writes through ``open`` (whole objects), deletion, and no-op directory creation
(an object store has no directories). Endpoint and credentials come from the standard AWS configuration, as for
every ckptio S3 access.
"""

from __future__ import annotations

import importlib.util
import io
from datetime import datetime
from typing import Any

from fsspec.spec import AbstractFileSystem

from ._common import MANIFEST, PENDING, _call, _missing, client

__all__ = ["CkptioS3FileSystem", "register"]


class CkptioS3FileSystem(AbstractFileSystem):
    """``s3://bucket/key`` through ckptio's S3 client (see the module's documentation)."""

    protocol = ("s3", "s3a")
    root_marker = ""

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path[0] if isinstance(path, list) else path)
        for prefix in ("s3://", "s3a://"):
            if text.startswith(prefix):
                text = text[len(prefix):]
        return text.rstrip("/")

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = self._strip_protocol(path).partition("/")
        return bucket, key

    def _has(self, bucket: str, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            client().head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if _missing(exc):
                return False
            raise
        return True

    def _in_progress(self, bucket: str, prefix: str) -> bool:
        return self._has(bucket, f"{prefix}/{PENDING}") and not self._has(bucket, f"{prefix}/{MANIFEST}")

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> list[Any]:
        bucket, key = self._split(path)
        prefix = f"{key}/" if key else ""
        pages = _call("listing", f"s3://{bucket}/{prefix}", lambda: list(
            client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")))
        out: list[dict[str, Any]] = []
        for page in pages:
            for common in page.get("CommonPrefixes", []):
                sub = common["Prefix"].rstrip("/")
                if not self._in_progress(bucket, sub):
                    out.append({"name": f"{bucket}/{sub}", "size": 0, "type": "directory"})
            for obj in page.get("Contents", []):
                if obj["Key"] != prefix:
                    out.append({"name": f"{bucket}/{obj['Key']}", "size": int(obj["Size"]), "type": "file",
                                "LastModified": obj["LastModified"]})
        if not out and key:
            out = [self.info(path)]  # a file, or FileNotFoundError
        return out if detail else [e["name"] for e in out]

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        from botocore.exceptions import ClientError

        bucket, key = self._split(path)
        if not key:
            return {"name": bucket, "size": 0, "type": "directory"}
        try:
            head = client().head_object(Bucket=bucket, Key=key)
            return {"name": f"{bucket}/{key}", "size": int(head["ContentLength"]), "type": "file",
                    "LastModified": head["LastModified"]}
        except ClientError as exc:
            if not _missing(exc):
                raise
        listed = client().list_objects_v2(Bucket=bucket, Prefix=f"{key}/", MaxKeys=1)
        if listed.get("KeyCount", 0) and not self._in_progress(bucket, key):
            return {"name": f"{bucket}/{key}", "size": 0, "type": "directory"}
        raise FileNotFoundError(f"s3://{bucket}/{key}")

    def modified(self, path: Any) -> datetime:
        """A file's time; a folder's is its manifest's (when it was committed), else its newest object's."""
        info = self.info(path)
        if info["type"] == "file":
            return info["LastModified"]
        bucket, key = self._split(path)
        if self._has(bucket, f"{key}/{MANIFEST}"):
            return client().head_object(Bucket=bucket, Key=f"{key}/{MANIFEST}")["LastModified"]
        pages = client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{key}/")
        return max(o["LastModified"] for page in pages for o in page.get("Contents", []))

    def _open(self, path: Any, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        bucket, key = self._split(path)
        if "r" in mode:
            body = _call("reading", f"s3://{bucket}/{key}", client().get_object, Bucket=bucket, Key=key)["Body"]
            return io.BytesIO(body.read())
        return _Upload(bucket, key)

    def mkdir(self, path: Any, create_parents: bool = True, **kwargs: Any) -> None:
        pass  # no directories in an object store: a folder exists once an object is under it

    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        pass

    def rmdir(self, path: Any) -> None:
        pass

    def rm_file(self, path: Any) -> None:
        bucket, key = self._split(path)
        _call("removing", f"s3://{bucket}/{key}", client().delete_object, Bucket=bucket, Key=key)

    def _rm(self, path: Any) -> None:
        self.rm_file(path)


class _Upload(io.BytesIO):
    """Bytes written, put as one object when closed."""

    def __init__(self, bucket: str, key: str) -> None:
        super().__init__()
        self.bucket, self.key = bucket, key

    def close(self) -> None:
        if not self.closed:
            _call("writing", f"s3://{self.bucket}/{self.key}", client().put_object, Bucket=self.bucket, Key=self.key,
                  Body=self.getvalue())
        super().close()


def register() -> bool:
    """Make ``s3://`` paths in fsspec use :class:`CkptioS3FileSystem`, unless s3fs is installed (then fsspec uses
    s3fs, as it would without ckptio). Returns whether it was registered."""
    import fsspec

    if importlib.util.find_spec("s3fs") is not None:
        return False
    for protocol in CkptioS3FileSystem.protocol:
        fsspec.register_implementation(protocol, CkptioS3FileSystem, clobber=True)
    return True
