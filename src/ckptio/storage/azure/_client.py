"""What every part of the Azure backend shares: settings, locations, the client (credentials as Azure users set
them) and error mapping."""

from __future__ import annotations

import os
import re
import threading
from typing import Any

from ...errors import CheckpointNotFoundError, ConfigError, require
from ..objstore._store import NET_ENV, ObjectPath, ObjectStoreError, PreconditionFailed, environment_network, parse_url

CONNECT_TIMEOUT = 10
READ_TIMEOUT = 120
RETRIES = 6
"""Times a request is tried again (exponential backoff from 1 s: about a minute in all) on 408, 5xx and dropped
connections before it fails."""
THREADS = 4
"""Requests at once for one large upload (its blocks) and for removing many objects."""
SINGLE_PUT = 64 << 20
"""A file up to this size goes up in one request; a larger one in blocks of :data:`BLOCK` (the client's defaults). A
file a save writes likewise, a larger one in a first block of this size then blocks of :data:`UPLOAD_BLOCK`."""
BLOCK = 4 << 20
UPLOAD_BLOCK = 16 << 20
"""The blocks a file written by a save is uploaded in, from memory, after its first
(:class:`~.bucket.AzureWriteStream`)."""
UPLOAD_THREADS = 2
"""Blocks of one such file staged at once (measured: 16 MiB blocks 2 at a time cost ~15% less CPU than 8 MiB 4 at a
time, the client's pipeline running once a block)."""
READ_CHUNK = 16 << 20
"""Bytes of one ranged ``GET`` of the client's downloads (``max_single_get_size``, ``max_chunk_get_size``): a
:meth:`~.bucket.AzureBucket.get` (a pointer, a lease, a manifest); a folder's reads are one ``GET`` each
(:mod:`.download`). The client's defaults (32 MiB
first, then 4 MiB) made a restore's 170 MB read 35 requests; the client joins each chunk's bytes before they are
copied into the reader's buffer, and a chunk of 32 MiB or more is a new mapping of memory every time (glibc's
threshold), its pages faulted in again. Measured on a 170 MB read (cpu-s/GB): 4 MiB 1.2, 8 MiB 0.9, 16 MiB 0.8,
32 MiB 1.4, 64 MiB 1.6."""
READ_BLOCK = 4 << 20
"""Bytes the client reads of a response body at a time (``connection_data_block_size``; its default, 256 KiB, made
a 16 MiB chunk 64 reads through its stream generator, ~5,000 Python calls for a 24 MiB read: a 4-rank restore's
CPU). The pieces are joined into the chunk as before."""
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


_HOST = re.compile(r"(?P<account>[a-z0-9]{3,24})\.(?:dfs|blob)\.core\.windows\.net")


def parse_az_url(url: str) -> tuple[str, str, str]:
    """``az://container/some/prefix`` (or ``abfs://``) -> ``("az", "container", "some/prefix")``; a malformed URL is a
    :class:`ConfigError`. As fsspec (adlfs) reads it, the container may name its storage account:
    ``abfs://container@account.dfs.core.windows.net/prefix`` (or ``.blob.``) gives ``"container@account.dfs..."``,
    which :func:`split_account` takes apart; without it the account is the credentials' (see :func:`client`)."""
    scheme = url.partition("://")[0]
    if scheme not in SCHEMES:
        raise ConfigError(f"{url!r} is not an az:// or abfs:// location")
    container, prefix = parse_url(url, scheme)
    try:
        split_account(container)
    except ValueError as exc:
        raise ConfigError(f"{url!r}: {exc}") from None
    return scheme, container, prefix


def split_account(name: str) -> tuple[str, str | None]:
    """``"container@account.dfs.core.windows.net"`` -> ``("container", "account")``; ``"container"`` ->
    ``("container", None)``. Anything else after the ``@`` is a ``ValueError`` saying what is expected."""
    container, at, host = name.partition("@")
    if not at:
        return name, None
    match = _HOST.fullmatch(host)
    if not container or match is None:
        raise ValueError(f"{name!r} is not container@<account>.dfs.core.windows.net (or .blob.core.windows.net), "
                         f"the storage account's name being 3 to 24 lowercase letters and digits")
    return container, match["account"]


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def client(account: str | None = None) -> Any:
    """An ``azure.storage.blob.BlobServiceClient`` (one per process, ``account`` and set of settings) for the storage
    ``account`` a URL names (``abfs://container@account.dfs.core.windows.net``), else for the credentials' account:
    settings naming another account are a :class:`ConfigError` naming both. Credentials, in this order:
    ``AZURE_STORAGE_CONNECTION_STRING``; the account (``AZURE_STORAGE_ACCOUNT_URL``, or ``AZURE_STORAGE_ACCOUNT_NAME``
    for ``https://<name>.blob.core.windows.net``) with ``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_SAS_TOKEN``;
    the account alone with ``DefaultAzureCredential`` when ``azure-identity`` is installed (environment, workload or
    managed identity, ``az login``). ``AZURE_STORAGE_ACCOUNT`` and ``AZURE_STORAGE_KEY`` (the ``az`` CLI's names) are
    read too."""
    blob = require("azure.storage.blob", extra="azure", purpose="checkpoints in Azure Blob Storage (az://)",
                   package="azure-storage-blob")
    env = {k: os.environ.get(k) for k in _ENV}
    key = (os.getpid(), account, RETRIES, SINGLE_PUT, BLOCK, CONNECT_TIMEOUT, READ_TIMEOUT, READ_CHUNK, READ_BLOCK,
           *env.values(),
           *(os.environ.get(k) for k in NET_ENV))
    with _clients_lock:
        if key not in _clients:
            _clients[key] = _make(blob, env, account)
        return _clients[key]


def _make(blob: Any, env: dict[str, str | None], account: str | None) -> Any:
    options = {"connection_timeout": CONNECT_TIMEOUT, "read_timeout": READ_TIMEOUT, "max_single_put_size": SINGLE_PUT,
               "max_block_size": BLOCK,
               "retry_policy": blob.ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=RETRIES,
                                                     retry_to_secondary=False)}
    options.update(max_single_get_size=READ_CHUNK, max_chunk_get_size=READ_CHUNK, connection_data_block_size=READ_BLOCK)
    if env["AZURE_STORAGE_CONNECTION_STRING"]:
        try:
            endpoint = blob.BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"]).url
            made = blob.BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"], **options,
                                                                 **_net_options(endpoint))
        except ValueError as exc:
            raise AzureError(f"AZURE_STORAGE_CONNECTION_STRING cannot be used: {exc}") from None
        _same_account(account, made.account_name, "AZURE_STORAGE_CONNECTION_STRING")
        return made
    name = env["AZURE_STORAGE_ACCOUNT_NAME"] or env["AZURE_STORAGE_ACCOUNT"]
    _same_account(account, name, "AZURE_STORAGE_ACCOUNT_NAME" if env["AZURE_STORAGE_ACCOUNT_NAME"] else
                  "AZURE_STORAGE_ACCOUNT")
    name = name or account
    url = env["AZURE_STORAGE_ACCOUNT_URL"] or (f"https://{name}.blob.core.windows.net" if name else None)
    if url is None:
        raise AzureError("no Azure storage account for az://: set AZURE_STORAGE_CONNECTION_STRING, or "
                         "AZURE_STORAGE_ACCOUNT_NAME (or AZURE_STORAGE_ACCOUNT_URL) with AZURE_STORAGE_ACCOUNT_KEY, "
                         "AZURE_STORAGE_SAS_TOKEN or an identity DefaultAzureCredential finds (pip install "
                         "'ckptio[azure]'), or name the account in the location: "
                         "abfs://container@account.dfs.core.windows.net/path")
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
                             "for DefaultAzureCredential (az login, a managed or workload identity): pip install "
                             "'ckptio[azure]'") from None
        credential = DefaultAzureCredential()
    try:
        return blob.BlobServiceClient(url, credential=credential, **options, **_net_options(url))
    except ValueError as exc:  # a malformed account URL; a token (DefaultAzureCredential) over plain HTTP
        raise AzureError(f"the Azure storage account {url} cannot be used: {exc}") from None


def _net_options(url: str) -> dict[str, Any]:
    """The client's settings for the environment's proxy and CA bundle, looked up once for the account's endpoint
    (:func:`~..objstore._store.environment_network`; one host, so one proxy for every request): the client then reads
    no environment at a request."""
    proxies, verify = environment_network(url)
    return {"use_env_settings": False, "proxies": proxies or None, "connection_verify": verify}


def _same_account(wanted: str | None, have: str | None, setting: str) -> None:
    if wanted is not None and have and have != wanted:
        raise ConfigError(f"the location names the storage account {wanted!r} but {setting} is for the account "
                          f"{have!r}: name one account (the location's, or none and the settings')")


def _call(what: str, where: object, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with a failure raised as :class:`AzureError` naming ``what`` and ``where`` (a missing
    blob as :class:`~ckptio.errors.CheckpointNotFoundError`, a failed condition as
    :class:`AzurePreconditionFailed`)."""
    from azure.core import exceptions as az

    try:
        return fn(*args, **kwargs)
    except az.ResourceNotFoundError as exc:
        if _code(exc) == "ContainerNotFound":  # not a missing blob: nothing in this location can be saved or read
            container = split_account(str(getattr(where, "bucket", where)))[0]
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
