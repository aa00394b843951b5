"""An S3 bucket through boto3, as the object-store folder needs it (:class:`~ckptio.storage.objstore._store.Bucket`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import CheckpointNotFoundError
from ..objstore._store import Bucket, Obj, ObjectPath, fill
from ._common import S3Error, S3Path, _call, client
from .writer import S3WriteStream, upload_file


class S3Bucket(Bucket):
    """One S3 bucket (endpoint and credentials from the standard AWS configuration)."""

    path_type = S3Path

    def listing(self, prefix: str, *, delimiter: bool) -> tuple[list[Obj], list[str]]:
        paginator = client().get_paginator("list_objects_v2")
        extra = {"Delimiter": "/"} if delimiter else {}
        pages = _call("listing", self.path(prefix), lambda: list(
            paginator.paginate(Bucket=self.name, Prefix=prefix, **extra)))
        objects = [Obj(o["Key"], int(o["Size"]), o["LastModified"].timestamp(), o.get("ETag"))
                   for page in pages for o in page.get("Contents", [])]
        return objects, [c["Prefix"] for page in pages for c in page.get("CommonPrefixes", [])]

    def head(self, key: str) -> Obj | None:
        try:
            head = _call("looking up", self.path(key), client().head_object, Bucket=self.name, Key=key)
        except CheckpointNotFoundError:
            return None
        return Obj(key, int(head.get("ContentLength", -1)), head["LastModified"].timestamp(), head.get("ETag"))

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_token: Any = None) -> None:
        extra = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_token} if if_token is not None else {}
        _call("writing", self.path(key), client().put_object, Bucket=self.name, Key=key, Body=data, **extra)

    def get(self, key: str, limit: int) -> tuple[bytes, Any]:
        got = _call("reading", self.path(key), client().get_object, Bucket=self.name, Key=key)
        body = got["Body"]
        try:
            return body.read(limit), got.get("ETag")
        finally:
            body.close()

    def read_into(self, key: str, offset: int, view: memoryview) -> int:
        n = view.nbytes
        response = _call("reading", self.path(key), client().get_object, Bucket=self.name, Key=key,
                         Range=f"bytes={offset}-{offset + n - 1}")
        body = response["Body"]
        try:
            return fill(body.read, view)
        finally:
            body.close()

    def delete(self, key: str) -> None:
        _call("removing", self.path(key), client().delete_object, Bucket=self.name, Key=key)

    def delete_many(self, keys: list[str], where: object) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            result = _call("removing objects under", where, client().delete_objects, Bucket=self.name,
                           Delete={"Objects": batch, "Quiet": True})
            errors = result.get("Errors") or []
            if errors:
                first = errors[0]
                raise S3Error(f"removing {self.path(first.get('Key', '?'))} failed: "
                              f"{first.get('Code')}: {first.get('Message')} ({len(errors)} object(s) not removed)")

    def copy(self, src: str, dst: str) -> None:
        # the managed copy: server-side, in parts for an object beyond one request's 5 GB
        _call("copying", self.path(src), client().copy, {"Bucket": self.name, "Key": src}, self.name, dst)

    def upload_file(self, path: Path, key: str, *, if_absent: bool = False) -> None:
        upload_file(path, self.name, key, self.path(key), if_none_match=if_absent)

    def open_stream(self, spool: Path | None, key: str) -> S3WriteStream:
        assert spool is not None, "an S3 upload spools its parts"
        return S3WriteStream(spool, self.name, key, self.path(key))  # type: ignore[arg-type]

    def sweep_uploads(self, prefix: str, older_than_s: float, now: float) -> list[ObjectPath]:
        s3 = client()
        removed: list[ObjectPath] = []
        uploads = _call("listing the unfinished uploads of", self.path(prefix), s3.list_multipart_uploads,
                        Bucket=self.name, Prefix=prefix)
        for up in uploads.get("Uploads", []):
            if now - up["Initiated"].timestamp() >= older_than_s:
                try:
                    s3.abort_multipart_upload(Bucket=self.name, Key=up["Key"], UploadId=up["UploadId"])
                except Exception:  # noqa: BLE001 - another sweep may have aborted it
                    continue
                removed.append(self.path(up["Key"]))
        return removed
