"""What every part of the Azure backend shares: settings, locations, the client (credentials as Azure users set
them) and error mapping."""

from __future__ import annotations

import os
import threading
from typing import Any

from ...errors import CheckpointNotFoundError, ConfigError, require
from ..objstore._store import ObjectPath, ObjectStoreError, PreconditionFailed, parse_url

CONNECT_TIMEOUT = 10
READ_TIMEOUT = 120
RETRIES = 6
"""Times a request is tried again (exponential backoff from 1 s: about a minute in all) on 408, 5xx and dropped
connections before it fails."""
THREADS = 4
"""Requests at once for one large upload (its blocks) and for removing many objects."""
SINGLE_PUT = 64 << 20
"""A file up to this size goes up in one request; a larger one in blocks of :data:`BLOCK` (the client's defaults)."""
BLOCK = 4 << 20
SCHEMES = ("az", "abfs")
"""fsspec's (adlfs's) two names for a blob container: ``az://container/path`` and ``abfs://container/path``."""
_ENV = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_URL", "AZURE_STORAGE_ACCOUNT_NAME",
        "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN")


class AzureError(ObjectStoreError):
    """A request to Azure Blob Storage failed (after its retries); names the object and the server's answer."""


class AzurePreconditionFailed(AzureError, PreconditionFailed):
    """A conditional write answered ``409 BlobAlreadyExists`` (``If-None-Match: *``) or ``412 Condition Not Met``
    (``If-Match``)."""


class AzPath(ObjectPath):
    """The name of a blob or a prefix, shown as ``az://container/key`` (see :class:`ObjectPath`)."""

    scheme = "az"


class AbfsPath(AzPath):
    """The same, for a folder given as ``abfs://container/key``: shown as it was given."""

    scheme = "abfs"


def parse_az_url(url: str) -> tuple[str, str, str]:
    """``az://container/some/prefix`` (or ``abfs://``) -> ``("az", "container", "some/prefix")``; a malformed URL is a
    :class:`ConfigError`. The account is the credentials' (see :func:`client`), never part of the URL."""
    scheme = url.partition("://")[0]
    if scheme not in SCHEMES:
        raise ConfigError(f"{url!r} is not an az:// or abfs:// location")
    container, prefix = parse_url(url, scheme)
    if "@" in container:
        raise ConfigError(f"{url!r}: name the container alone ({scheme}://container/path); the storage account is "
                          "the one of AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME")
    return scheme, container, prefix


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def client() -> Any:
    """An ``azure.storage.blob.BlobServiceClient`` (one per process and set of settings). Credentials, in this order:
    ``AZURE_STORAGE_CONNECTION_STRING``; the account (``AZURE_STORAGE_ACCOUNT_URL``, or ``AZURE_STORAGE_ACCOUNT_NAME``
    for ``https://<name>.blob.core.windows.net``) with ``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_SAS_TOKEN``;
    the account alone with ``DefaultAzureCredential`` when ``azure-identity`` is installed (environment, workload or
    managed identity, ``az login``). ``AZURE_STORAGE_ACCOUNT`` and ``AZURE_STORAGE_KEY`` (the ``az`` CLI's names) are
    read too."""
    blob = require("azure.storage.blob", extra="azure", purpose="checkpoints in Azure Blob Storage (az://)",
                   package="azure-storage-blob")
    env = {k: os.environ.get(k) for k in _ENV}
    key = (os.getpid(), RETRIES, SINGLE_PUT, BLOCK, *env.values())
    with _clients_lock:
        if key not in _clients:
            _clients[key] = _make(blob, env)
        return _clients[key]


def _make(blob: Any, env: dict[str, str | None]) -> Any:
    options = {"connection_timeout": CONNECT_TIMEOUT, "read_timeout": READ_TIMEOUT, "max_single_put_size": SINGLE_PUT,
               "max_block_size": BLOCK,
               "retry_policy": blob.ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=RETRIES,
                                                     retry_to_secondary=False)}
    if env["AZURE_STORAGE_CONNECTION_STRING"]:
        try:
            return blob.BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"], **options)
        except ValueError as exc:
            raise AzureError(f"AZURE_STORAGE_CONNECTION_STRING cannot be used: {exc}") from None
    name = env["AZURE_STORAGE_ACCOUNT_NAME"] or env["AZURE_STORAGE_ACCOUNT"]
    url = env["AZURE_STORAGE_ACCOUNT_URL"] or (f"https://{name}.blob.core.windows.net" if name else None)
    if url is None:
        raise AzureError("no Azure storage account for az://: set AZURE_STORAGE_CONNECTION_STRING, or "
                         "AZURE_STORAGE_ACCOUNT_NAME (or AZURE_STORAGE_ACCOUNT_URL) with AZURE_STORAGE_ACCOUNT_KEY, "
                         "AZURE_STORAGE_SAS_TOKEN or an identity DefaultAzureCredential finds (pip install "
                         "azure-identity)")
    secret = env["AZURE_STORAGE_ACCOUNT_KEY"] or env["AZURE_STORAGE_KEY"]
    credential: Any
    if secret:
        name = name or url.split("//", 1)[-1].split(".", 1)[0]
        credential = {"account_name": name, "account_key": secret}
    elif env["AZURE_STORAGE_SAS_TOKEN"]:
        credential = env["AZURE_STORAGE_SAS_TOKEN"].lstrip("?")
    else:
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError:
            raise AzureError(f"no credentials for the Azure storage account {url}: set AZURE_STORAGE_ACCOUNT_KEY or "
                             "AZURE_STORAGE_SAS_TOKEN, or AZURE_STORAGE_CONNECTION_STRING, or install azure-identity "
                             "for DefaultAzureCredential (az login, a managed or workload identity)") from None
        credential = DefaultAzureCredential()
    return blob.BlobServiceClient(url, credential=credential, **options)


def _call(what: str, where: object, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with a failure raised as :class:`AzureError` naming ``what`` and ``where`` (a missing
    blob as :class:`~ckptio.errors.CheckpointNotFoundError`, a failed condition as
    :class:`AzurePreconditionFailed`)."""
    from azure.core import exceptions as az

    try:
        return fn(*args, **kwargs)
    except az.ResourceNotFoundError as exc:
        if _code(exc) == "ContainerNotFound":  # not a missing blob: nothing in this location can be saved or read
            container = getattr(where, "bucket", where)
            raise AzureError(f"{what} {where} failed: the container {container!r} does not exist (ContainerNotFound); "
                             f"ckptio saves into an existing container and never creates one: create it first (az "
                             f"storage container create --name {container}), or check its name and the storage "
                             f"account") from None
        raise CheckpointNotFoundError(f"{where}: missing (404 {_code(exc)})") from None
    except az.HttpResponseError as exc:
        if exc.status_code is None:  # no answer to report: no token for the identity (DefaultAzureCredential)
            raise AzureError(f"{what} {where} failed: {type(exc).__name__}: {_first_line(exc)}") from None
        if exc.status_code == 412 or _code(exc) == "BlobAlreadyExists":
            raise AzurePreconditionFailed(f"{what} {where} failed: {exc.status_code} {_code(exc)}") from None
        hint = "" if exc.status_code not in (401, 403) else (
            ": check the account's credentials (AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_KEY, "
            "AZURE_STORAGE_SAS_TOKEN, or the identity's role: Storage Blob Data Contributor)")
        raise AzureError(f"{what} {where} failed: {exc.status_code} {_code(exc)}{hint}") from None
    except (az.AzureError, ConnectionError, TimeoutError) as exc:
        raise AzureError(f"{what} {where} failed: {type(exc).__name__}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:300]


def _code(exc: Any) -> str:
    code = getattr(exc, "error_code", None) or getattr(exc, "reason", None) or ""
    return str(getattr(code, "value", code))
