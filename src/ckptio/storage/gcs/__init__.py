"""Checkpoint folders in Google Cloud Storage: ``gs://bucket/prefix``.

The folder's protocol (manifest-last commit with a create-only write, the lease, retention, references, the sweep)
is the object store's, :mod:`ckptio.storage.objstore`; this package is its GCS bucket (:class:`~.bucket.GCSBucket`)
through the maintained client, ``google-cloud-storage`` (``pip install 'ckptio[gcs]'``): a create-only write is
``ifGenerationMatch=0`` (the manifest that commits a step, the writer lease), a takeover of a stale lease
``ifGenerationMatch=<its generation>``.

Credentials are the application default credentials (``gcloud auth application-default login``,
``GOOGLE_APPLICATION_CREDENTIALS``, or the service account of a VM); with ``STORAGE_EMULATOR_HOST`` set
(``http://127.0.0.1:4443``) the client talks to that emulator, unauthenticated. Every request is bounded in time and
retried on transient errors for up to :data:`~._client.DEADLINE` seconds; a failure is raised naming the object and
the server's error.
"""

from __future__ import annotations

from ..objstore import ObjectStorage
from ._client import GCSError, GCSPreconditionFailed, GSPath, _call, client, parse_gs_url, timeout
from .bucket import GCSBucket, GCSWriteStream

__all__ = ["GCSStorage", "GCSBucket", "GCSWriteStream", "GCSError", "GCSPreconditionFailed", "GSPath", "client",
           "parse_gs_url"]


class GCSStorage(ObjectStorage):
    """A checkpoint folder in a GCS bucket, ``gs://bucket/prefix`` (see
    :class:`~ckptio.storage.objstore.ObjectStorage`)."""

    def __init__(self, url: str) -> None:
        bucket, prefix = parse_gs_url(url)
        super().__init__(GCSBucket(bucket), prefix)

    def check_writable(self) -> None:
        """The bucket must exist (ckptio never creates one); a bucket that cannot be looked up (no permission to
        read its metadata, no connection) is left to the requests that follow, which name what they met."""
        try:
            exists = _call("looking up", self.root, client().bucket(self.bucket).exists, timeout=timeout())
        except GCSError:
            return
        if not exists:
            raise GCSError(f"{self.root}: the bucket {self.bucket!r} does not exist; ckptio saves into an existing "
                           f"bucket and never creates one: create it first (gcloud storage buckets create "
                           f"gs://{self.bucket}), or check its name and STORAGE_EMULATOR_HOST")
