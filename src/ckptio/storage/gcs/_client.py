"""What every part of the GCS backend shares: settings, locations, the client and error mapping."""

from __future__ import annotations

import os
import threading
from typing import Any
from urllib.parse import quote

from ...errors import CheckpointNotFoundError, require
from ..objstore._store import NET_ENV, ObjectPath, ObjectStoreError, PreconditionFailed, environment_network, parse_url

CONNECT_TIMEOUT = 10
READ_TIMEOUT = 120
DEADLINE = 120.0
"""Seconds a request is retried for (exponential backoff on 429, 5xx and dropped connections) before it fails."""
DELETE_THREADS = 8
"""Objects removed at once (GCS's JSON API deletes one object a request)."""


class GCSError(ObjectStoreError):
    """A request to Google Cloud Storage failed (after its retries); names the object and the server's answer."""


class GCSPreconditionFailed(GCSError, PreconditionFailed):
    """A conditional write (``ifGenerationMatch``) answered ``412 Precondition Failed``."""


class GSPath(ObjectPath):
    """The name of an object or a prefix, shown as ``gs://bucket/key`` (see :class:`ObjectPath`)."""

    scheme = "gs"


def parse_gs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; a malformed URL is a :class:`ConfigError`."""
    return parse_url(url, "gs")


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def client() -> Any:
    """A ``google.cloud.storage`` client (one per process and emulator endpoint): credentials are the application
    default credentials, or none when ``STORAGE_EMULATOR_HOST`` names an emulator."""
    storage = require("google.cloud.storage", extra="gcs", purpose="checkpoints in Google Cloud Storage (gs://)",
                      package="google-cloud-storage")
    key = (os.getpid(), os.environ.get("STORAGE_EMULATOR_HOST", ""), *(os.environ.get(k) for k in NET_ENV))
    with _clients_lock:
        if key not in _clients:
            from google.auth.exceptions import GoogleAuthError

            try:
                made = storage.Client()
            except GoogleAuthError as exc:
                raise GCSError(f"no Google Cloud credentials for gs:// ({exc}); set up application default "
                               "credentials (`gcloud auth application-default login`, GOOGLE_APPLICATION_CREDENTIALS "
                               "naming a key file, or a VM's service account), or STORAGE_EMULATOR_HOST for an "
                               "emulator") from None
            # the environment's proxy and CA bundle looked up once, not at every request (one endpoint)
            session = made._http
            session.proxies, session.verify = environment_network(made.api_endpoint)
            session.trust_env = False
            _clients[key] = made
        return _clients[key]


def retry() -> Any:
    """Every request's retry policy: the client's transient errors, for up to :data:`DEADLINE` seconds. Writes are
    retried too (a whole object is written or not; a create-only write that did land is told apart at commit)."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_timeout(DEADLINE)


def timeout() -> tuple[float, float]:
    """Every request's (connect, read) timeouts in seconds: a server that accepts no connection, or stalls mid-answer,
    for that long is a ``ReadTimeout``/``ConnectTimeout`` the retry policy retries, then reported by name."""
    return (CONNECT_TIMEOUT, READ_TIMEOUT)


def objects_url(bucket: str, key: str | None = None, *, api: str = "") -> str:
    """The JSON API's URL of the bucket's objects (``key``: of that object, its name URL-quoted whole: ``/``, ``#``,
    ``?``, spaces, non-ASCII) at the client's endpoint (``STORAGE_EMULATOR_HOST``, or the client's ``api_endpoint``);
    ``api``: ``"upload"`` or ``"download"`` for the media endpoints."""
    base = f"{client().api_endpoint}{'/' + api if api else ''}/storage/v1/b/{quote(bucket, safe='')}/o"
    return base if key is None else f"{base}/{quote(key, safe='')}"


def request(what: str, where: object, method: str, url: str, *, ok: tuple[int, ...] = (200,),
            read: Any = None, **kwargs: Any) -> Any:
    """One request of the JSON API sent straight through the client's own authorized session (its credentials,
    proxies and CA bundle), bounded by :func:`timeout` and retried by :func:`retry` as the client's own calls are,
    with :func:`_call`'s error mapping (an answer not in ``ok`` is raised as the client raises it). Returns the answer,
    or ``read(answer)`` (which reads its body inside the retried call: a body cut short is asked for again). The
    client's high-level calls cost ~0.2 ms more CPU a request here (~0.95 ms against ~0.75; Blob objects, its upload
    and retry wrappers), a listing ~15 us more an object (a Blob each), a read of a small object twice as much (two
    requests: its generation, then its bytes)."""
    from google.api_core.exceptions import from_http_response

    http = client()._http

    def run() -> Any:
        answer = http.request(method, url, timeout=timeout(), **kwargs)
        try:
            if answer.status_code not in ok:
                raise from_http_response(answer)
            return answer if read is None else read(answer)
        finally:
            if read is not None:
                answer.close()

    return _call(what, where, retry()(run))


def _call(what: str, where: object, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with a failure raised as :class:`GCSError` naming ``what`` and ``where`` (a missing
    object as :class:`~ckptio.errors.CheckpointNotFoundError`, a failed condition as :class:`GCSPreconditionFailed`)."""
    from google.api_core import exceptions as api
    from google.auth.exceptions import GoogleAuthError
    from requests import RequestException

    try:
        return fn(*args, **kwargs)
    except api.NotFound:
        raise CheckpointNotFoundError(f"{where}: missing (404)") from None
    except api.PreconditionFailed as exc:
        raise GCSPreconditionFailed(f"{what} {where} failed: 412 Precondition Failed: {exc.message}") from None
    except api.GoogleAPICallError as exc:
        raise GCSError(f"{what} {where} failed: {exc.code}: {exc.message}") from None
    except (api.RetryError, GoogleAuthError, RequestException, ConnectionError, TimeoutError) as exc:
        raise GCSError(f"{what} {where} failed: {type(exc).__name__}: {exc}") from None
