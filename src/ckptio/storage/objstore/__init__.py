"""Checkpoint folders in object storage, whatever the cloud: ``s3://bucket/prefix`` (:mod:`ckptio.storage.s3`),
``gs://bucket/prefix`` (:mod:`ckptio.storage.gcs`).

An object store has no rename and no directories, so the local protocol (write a temporary folder,
rename it into place) becomes this one, with the same guarantee — discovery never takes a step that is
not complete:

* a step ``name`` is the set of objects under ``prefix/name/``; it is **committed** when its manifest
  object exists, and the manifest is written last, by one writer, after every rank has uploaded and
  confirmed its files, with a create-only write (S3's ``If-None-Match: *``, GCS's ``ifGenerationMatch=0``)
  so two writers can never both commit the same step;
* each file is spooled to a local temporary file while it is written (checksummed as the bytes come) and
  uploaded as each backend does best (S3: parts sent while the file is written; GCS: one upload at close);
* before a step is written, whatever sits under its name (an interrupted save, an older step of that
  name) is removed — the manifest first; a step is deleted the same way, so a half-deleted step has no
  manifest and is never taken for a complete one;
* :meth:`ObjectStorage.sweep` removes objects of steps without a manifest and drops unfinished uploads
  left by a killed process where the store keeps them (S3's multipart uploads);
* the folder's writer lock is a lease object written create-only and renewed while held;
  a lease not renewed for :data:`LEASE_SECONDS` belongs to a process that is gone and may be taken over.

Reads go through :class:`~.reader.ObjectFolder`, which offers what the confined local
:class:`~ckptio.storage.confined.Folder` offers (listing, sizes, positional reads, checksumming while reading) with
ranged requests. Keys
that are not plain relative names (``..``, empty parts) are listed as ``other`` and never read.

Each backend is a :class:`~._store.Bucket`: the few requests above, through that cloud's own client, bounded in
time and retried on transient errors; a failure is raised naming the object and the server's error.
"""

from ._store import LEASE_SECONDS, Bucket, Obj, ObjectPath, ObjectStoreError, PreconditionFailed, parse_url
from .lease import ObjectLease
from .reader import ObjectFolder, ObjectReadHandle
from .storage import ObjectStorage
from .writer import ObjectFolderWriter

__all__ = ["Bucket", "Obj", "ObjectPath", "ObjectStorage", "ObjectFolder", "ObjectFolderWriter", "ObjectReadHandle",
           "ObjectLease", "ObjectStoreError", "PreconditionFailed", "parse_url", "LEASE_SECONDS"]
