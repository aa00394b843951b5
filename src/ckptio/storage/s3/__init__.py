"""Checkpoint folders in an S3-compatible object store: ``s3://bucket/prefix``.

The folder's protocol (manifest-last commit with a create-only write, the lease, retention, references, the sweep)
is the object store's, :mod:`ckptio.storage.objstore`; this package is its S3 bucket (:class:`~.bucket.S3Bucket`)
through boto3: a create-only write is ``If-None-Match: *``, a replacement of one version ``If-Match: <ETag>``,
and a large file goes up as a multipart upload whose parts are sent while it is written.

Endpoint, region and credentials come from the standard AWS configuration (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, or the config files). Every request is
bounded in time and retried on transient errors (:data:`CONNECT_TIMEOUT`, :data:`READ_TIMEOUT`,
:data:`MAX_ATTEMPTS`); a failure is raised naming the object and the server's error.
"""

from __future__ import annotations

from ..objstore import ObjectLease as S3Lease
from ..objstore import ObjectStorage
from ._common import (
    CONNECT_TIMEOUT,
    LEASE_SECONDS,
    MAX_ATTEMPTS,
    READ_TIMEOUT,
    S3Error,
    S3Path,
    _code,
    bucket_missing,
    client,
    parse_s3_url,
)
from .bucket import S3Bucket
from .reader import S3Folder, S3ReadHandle
from .writer import S3FolderWriter, S3WriteStream, upload_file

__all__ = ["S3Path", "S3Storage", "S3Bucket", "S3Folder", "S3FolderWriter", "S3ReadHandle", "S3WriteStream",
           "S3Lease", "S3Error", "parse_s3_url", "client", "upload_file", "CONNECT_TIMEOUT", "READ_TIMEOUT",
           "MAX_ATTEMPTS", "LEASE_SECONDS"]


class S3Storage(ObjectStorage):
    """A checkpoint folder in an S3 bucket, ``s3://bucket/prefix`` (see
    :class:`~ckptio.storage.objstore.ObjectStorage`)."""

    def __init__(self, url: str) -> None:
        bucket, prefix = parse_s3_url(url)
        super().__init__(S3Bucket(bucket), prefix)

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
