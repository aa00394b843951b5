"""Checkpoint folders in an S3-compatible object store: ``s3://bucket/prefix``.

An object store has no rename and no directories, so the local protocol (write a temporary folder,
rename it into place) becomes this one, with the same guarantee — discovery never takes a step that is
not complete:

* a step ``name`` is the set of objects under ``prefix/name/``; it is **committed** when its manifest
  object exists, and the manifest is written last, by one writer, after every rank has uploaded and
  confirmed its files, with a conditional put (``If-None-Match: *``) so two writers can never both
  commit the same step;
* each file is spooled to a local temporary file while it is written (checksummed as the bytes come),
  then uploaded when it is closed: one ``PUT`` for a small file, a multipart upload with parts sent in
  parallel for a large one;
* before a step is written, whatever sits under its name (an interrupted save, an older step of that
  name) is removed — the manifest first; a step is deleted the same way, so a half-deleted step has no
  manifest and is never taken for a complete one;
* :meth:`S3Storage.sweep` removes objects of steps without a manifest and aborts multipart uploads
  left by a killed process;
* the folder's writer lock is a lease object written with a conditional put and renewed while held;
  a lease not renewed for :data:`LEASE_SECONDS` belongs to a process that is gone and may be taken over.

Reads go through :class:`S3Folder`, which offers what the confined local :class:`~ckptio.storage.confined.Folder`
offers (listing, sizes, positional reads, checksumming while reading) with ranged ``GET`` requests. Keys
that are not plain relative names (``..``, empty parts) are listed as ``other`` and never read.

Endpoint, region and credentials come from the standard AWS configuration (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, or the config files). Every request is
bounded in time and retried on transient errors (:data:`CONNECT_TIMEOUT`, :data:`READ_TIMEOUT`,
:data:`MAX_ATTEMPTS`); a failure is raised naming the object and the server's error.
"""

from __future__ import annotations

import time
from pathlib import PurePosixPath
from typing import Any

from ..confined import check_relative
from ._common import (
    CONNECT_TIMEOUT,
    LEASE_SECONDS,
    MANIFEST,
    MAX_ATTEMPTS,
    MAX_POINTER_BYTES,
    PENDING,
    READ_TIMEOUT,
    S3Error,
    S3Path,
    _call,
    _code,
    bucket_missing,
    client,
    parse_s3_url,
)
from ...engine.manifest import held_by
from . import refs
from .lease import S3Lease
from .reader import S3Folder, S3ReadHandle
from .writer import S3FolderWriter, S3WriteStream, upload_file

__all__ = ["S3Path", "S3Storage", "S3Folder", "S3FolderWriter", "S3ReadHandle", "S3WriteStream", "S3Lease",
           "S3Error", "parse_s3_url", "client", "upload_file", "CONNECT_TIMEOUT", "READ_TIMEOUT", "MAX_ATTEMPTS",
           "LEASE_SECONDS"]

class S3Storage:
    """A checkpoint folder in an object store. See :class:`ckptio.storage.base.Storage` and this module."""

    refers = True
    """A step's manifest may refer to objects of another step (``shared``); see :mod:`ckptio.storage.s3.refs`."""

    def __init__(self, url: str) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.root = S3Path(self.bucket, *(p for p in self.prefix.split("/") if p))

    def __repr__(self) -> str:
        return f"S3Storage({str(self.root)!r})"

    def _key(self, rel: str) -> str:
        parts = check_relative(rel, self.root)
        return "/".join((self.prefix, *parts)) if self.prefix else "/".join(parts)

    def folder(self, rel: str = "", *, verifier: Any = None) -> S3Folder:
        top = S3Folder(self.bucket, self.prefix, verifier=verifier)
        top.holds_steps = True  # a step below it resolves its manifest's references
        return top.sub(rel) if rel else top

    def _objects(self, prefix: str) -> dict[str, dict[str, Any]]:
        """rel -> the listing entry (``Size``, ``LastModified``, …) of every object below ``prefix``, recursively."""
        paginator = client().get_paginator("list_objects_v2")
        out: dict[str, dict[str, Any]] = {}
        where = S3Path(self.bucket, *prefix.split("/"))
        for page in _call("listing", where, lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=prefix + "/"))):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(prefix) + 1:]] = obj
        return out

    def _delete_prefix(self, prefix: str, *, manifest_first: bool, objects: "dict[str, Any] | None" = None,
                       keep: "set[str] | frozenset[str]" = frozenset()) -> None:
        """Remove every object below ``prefix`` (``objects``: its listing, when the caller has it already) but those
        of ``keep`` (paths below it other steps refer to: they stay, with the in-progress mark, for the sweep)."""
        s3 = client()
        where = S3Path(self.bucket, *prefix.split("/"))
        keys = sorted(k for k in (self._objects(prefix) if objects is None else objects) if k not in keep)
        if manifest_first and MANIFEST in keys:
            # marked in progress before it is uncommitted, unmarked last: a removal cut short leaves a folder
            # sweep() recognises as ckptio's own, never one that looks like another tool's
            _call("writing", where / PENDING, s3.put_object, Bucket=self.bucket, Key=f"{prefix}/{PENDING}", Body=b"")
            _call("removing", where / MANIFEST, s3.delete_object, Bucket=self.bucket, Key=f"{prefix}/{MANIFEST}")
            from ... import _faults

            _faults.point("delete.after_hide")
            keys = [k for k in keys if k not in (MANIFEST, PENDING)] + ([] if keep else [PENDING])
        elif keep:
            keys = [k for k in keys if k != PENDING]
        for i in range(0, len(keys), 1000):
            batch = [{"Key": f"{prefix}/{k}"} for k in keys[i:i + 1000]]
            result = _call("removing objects under", where, s3.delete_objects, Bucket=self.bucket,
                           Delete={"Objects": batch, "Quiet": True})
            errors = result.get("Errors") or []
            if errors:
                first = errors[0]
                raise S3Error(f"removing {where}/{first.get('Key', '?')[len(prefix) + 1:]} failed: "
                              f"{first.get('Code')}: {first.get('Message')} ({len(errors)} object(s) not removed)")

    def begin_step(self, name: str) -> S3FolderWriter:
        # whatever sits under this name (an interrupted save, an older step of the same name) goes first,
        # manifest first, so no object of it can end up in the new step's listing; what other steps refer to is
        # handed over to them before
        prefix = self._key(name)
        if self._objects(prefix):
            refs.hand_over(self, name)
        self._delete_prefix(prefix, manifest_first=True)
        writer = S3FolderWriter(self, name)
        writer.mark_pending()
        return writer

    def attach_step(self, token: str, name: str) -> S3FolderWriter:
        return S3FolderWriter(self, name)

    def remove_step(self, name: str) -> None:
        """Remove the step, less the objects other committed steps refer to; then collect what it referred to that
        nothing refers to any more (objects of steps removed before, kept for it)."""
        every = refs.references(self)
        own = every.pop(name, {})
        held = held_by(every.values())
        self._delete_prefix(self._key(name), manifest_first=True, keep=held.get(name, set()))
        for owner in sorted({target.partition("/")[0] for target in own.values()}):
            objects = self._objects(self._key(owner))
            keep = held.get(owner, set())
            if MANIFEST not in objects and PENDING in objects and not (keep and set(objects) - {PENDING} <= keep):
                from ... import _faults

                _faults.point("sweep.before_remove")
                self._delete_prefix(self._key(owner), manifest_first=False, objects=objects, keep=keep)

    def remove_part(self, name: str, rel: str) -> None:
        """Remove the objects below ``rel`` of the step ``name``, and the object ``rel`` itself if there is one."""
        from ..confined import check_relative

        parts = check_relative(rel, self.root / name)
        key = self._key(name + "/" + "/".join(parts))
        referenced = refs.referenced(self, name)
        held = {r[len(rel) + 1:] for r in referenced if r.startswith(rel + "/")}
        self._delete_prefix(key, manifest_first=False, keep=held)
        if rel not in referenced:
            _call("removing", self.root / name / rel, client().delete_object, Bucket=self.bucket, Key=key)

    def sweep(self, older_than_s: float = 0.0) -> list[S3Path]:  # type: ignore[override]
        """Remove steps ckptio began and never committed (in-progress mark, no manifest) whose newest object is at
        least ``older_than_s`` old, and abort multipart uploads under the folder started that long ago. A folder
        without the mark (another tool's, such as a NeMo AutoModel step) is never removed."""
        s3 = client()
        now = time.time()
        removed: list[S3Path] = []
        base = f"{self.prefix}/" if self.prefix else ""
        held: dict[str, set[str]] | None = None  # step -> its objects committed steps refer to (read once, if needed)
        for entry in self.folder().listdir():
            if entry.kind != "dir" or entry.name.startswith("."):
                continue
            prefix = self._key(entry.name)
            objects = self._objects(prefix)
            newest = max((o["LastModified"].timestamp() for o in objects.values()), default=0.0)
            if MANIFEST not in objects and PENDING in objects and now - newest >= older_than_s:
                if held is None:
                    held = held_by(refs.references(self).values())
                keep = held.get(entry.name, set())
                if keep and set(objects) - {PENDING} <= keep:
                    continue  # only objects other steps still refer to: nothing to collect yet
                from ... import _faults

                _faults.point("sweep.before_remove")
                self._delete_prefix(prefix, manifest_first=False, objects=objects, keep=keep)
                removed.append(self.root / entry.name)  # type: ignore[arg-type]
        uploads = _call("listing the unfinished uploads of", self.root, s3.list_multipart_uploads,
                        Bucket=self.bucket, Prefix=base)
        for up in uploads.get("Uploads", []):
            if now - up["Initiated"].timestamp() >= older_than_s:
                try:
                    s3.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                except Exception:  # noqa: BLE001 - another sweep may have aborted it
                    continue
                removed.append(S3Path(self.bucket, *up["Key"].split("/")))
        return removed

    def write_pointer(self, name: str, target: str) -> None:
        data = (target + "\n").encode()
        _call("writing", self.root / name, client().put_object, Bucket=self.bucket, Key=self._key(name), Body=data)

    def write_small(self, name: str, data: bytes) -> None:
        """Replace the small object ``name`` at the root whole (one PUT: readers see the old or the new bytes)."""
        _call("writing", self.root / name, client().put_object, Bucket=self.bucket, Key=self._key(name), Body=data)

    def read_pointer(self, name: str) -> str | None:
        from ..posix import check_pointer_target

        folder = self.folder()
        if folder.kind(name) != "file":
            return None
        target = folder.read_text(name, max_size=MAX_POINTER_BYTES).strip()
        return check_pointer_target(target, self.root / name, self.root)

    def lock(self) -> "S3Lease":
        return S3Lease(self)

    def check_writable(self) -> None:
        """The bucket must exist (ckptio never creates one); other answers are left to the requests that follow."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            client().head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchBucket", "NotFound"):
                raise S3Error(f"{self.root}: {bucket_missing(self.bucket)}") from None
        except BotoCoreError:  # an endpoint that cannot be reached: the first listing says so, naming it
            pass


