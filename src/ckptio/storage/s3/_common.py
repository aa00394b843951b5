"""What every part of the S3 backend shares: settings, locations, the client and error mapping."""

from __future__ import annotations

import os
import threading
from typing import Any

from ...errors import CheckpointNotFoundError, require
from ..objstore._store import LEASE_SECONDS, MAX_POINTER_BYTES, ObjectPath, ObjectStoreError, PreconditionFailed
from ..objstore._store import MANIFEST, PENDING, parse_url

__all__ = ["LEASE_SECONDS", "MAX_POINTER_BYTES", "MANIFEST", "PENDING", "S3Error", "S3Path", "client", "parse_s3_url"]

PART_SIZE = 64 << 20
"""Files larger than this are uploaded as multipart uploads of parts this large (S3's minimum is 5 MiB)."""
UPLOAD_THREADS = 4
CONNECT_TIMEOUT = 10
READ_TIMEOUT = 120
MAX_ATTEMPTS = 5
"""Tries per request (standard retry mode: exponential backoff on throttling, 5xx and dropped connections)."""


class S3Error(ObjectStoreError):
    """A request to the object store failed (after its retries); names the object and the server's answer."""


class S3PreconditionFailed(S3Error, PreconditionFailed):
    """A conditional write (``If-None-Match``, ``If-Match``) answered ``412 PreconditionFailed``."""


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; a malformed URL is a :class:`ConfigError`."""
    return parse_url(url, "s3")


class S3Path(ObjectPath):
    """The name of an object or a prefix, shown as ``s3://bucket/key`` (see :class:`ObjectPath`)."""

    scheme = "s3"


# ------------------------------------------------------------------------------------------- the client
_clients: dict[tuple[int, str], Any] = {}
_clients_lock = threading.Lock()


def client() -> Any:
    """A boto3 S3 client with bounded timeouts and retries (one per process and thread pool size)."""
    boto3 = require("boto3", extra="s3", purpose="checkpoints in object storage (s3://)")
    from botocore.config import Config

    key = (os.getpid(), os.environ.get("AWS_ENDPOINT_URL", "") + os.environ.get("AWS_ENDPOINT_URL_S3", ""))
    with _clients_lock:
        if key not in _clients:
            config = Config(connect_timeout=CONNECT_TIMEOUT, read_timeout=READ_TIMEOUT,
                            retries={"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"},
                            max_pool_connections=4 * UPLOAD_THREADS,
                            # a body is not read once more for a SHA-256 in its signature (boto3 does so on an
                            # http:// endpoint): every upload carries a CRC-32C of its bytes that the server checks
                            # (ours, or boto3's own), as boto3's managed upload does on any endpoint
                            s3={"payload_signing_enabled": False})
            _clients[key] = boto3.session.Session().client("s3", config=config)
        return _clients[key]


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", "")) or str(response.get("ResponseMetadata", {}).get(
            "HTTPStatusCode", ""))
    return ""


def bucket_missing(bucket: str) -> str:
    """What to say of a bucket the store does not have."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
    return (f"the bucket {bucket!r} does not exist (NoSuchBucket, at {endpoint}); ckptio saves into an existing "
            f"bucket and never creates one: create it first (aws s3 mb s3://{bucket}), or check its name and "
            "AWS_ENDPOINT_URL / AWS_REGION")


def _missing(exc: BaseException) -> bool:
    return _code(exc) in ("NoSuchKey", "404", "NotFound", "NoSuchUpload")


CONFLICT_RETRIES = 6
"""Tries of a conditional write that S3 answers ``409 ConditionalRequestConflict`` (another conditional
write of the same key was in flight; S3 asks for a retry), with a doubling pause from 0.2 s."""


def _call(what: str, where: object, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with a failure raised as :class:`S3Error` naming ``what`` and ``where``.

    A conditional write (``IfNoneMatch``/``IfMatch``) answered ``409 ConditionalRequestConflict`` is tried
    again (its body rewound); the retry then wins, or fails with ``412 PreconditionFailed`` if the other
    write took the key. botocore's own retries do not cover that answer.
    """
    import time

    from botocore.exceptions import BotoCoreError, ClientError

    conditional = "IfNoneMatch" in kwargs or "IfMatch" in kwargs
    for attempt in range(CONFLICT_RETRIES):
        try:
            return fn(*args, **kwargs)
        except ClientError as exc:
            if _missing(exc):
                raise CheckpointNotFoundError(f"{where}: missing ({_code(exc)})") from None
            err = exc.response.get("Error", {})
            if err.get("Code") == "NoSuchBucket":
                raise S3Error(f"{what} {where} failed: {bucket_missing(str(getattr(where, 'bucket', '?')))}") from None
            if conditional and err.get("Code") == "ConditionalRequestConflict" and attempt + 1 < CONFLICT_RETRIES:
                seek = getattr(kwargs.get("Body"), "seek", None)
                if callable(seek):
                    seek(0)
                time.sleep(0.2 * 2 ** attempt)
                continue
            cls = S3PreconditionFailed if err.get("Code") == "PreconditionFailed" else S3Error
            raise cls(f"{what} {where} failed: {err.get('Code', '?')}: {err.get('Message', exc)}") from None
        except BotoCoreError as exc:
            raise S3Error(f"{what} {where} failed: {exc}") from None
    raise AssertionError("unreachable")


