"""Checkpoint folders in Azure Blob Storage: ``az://container/prefix`` (fsspec's and adlfs's scheme; ``abfs://`` too,
and as adlfs reads it ``abfs://container@account.dfs.core.windows.net/prefix``, naming the storage account).

The folder's protocol (manifest-last commit with a create-only write, the lease, retention, references, the sweep)
is the object store's, :mod:`ckptio.storage.objstore`; this package is its container (:class:`~.bucket.AzureBucket`)
through the maintained client, ``azure-storage-blob`` (``pip install 'ckptio[azure]'``): a create-only write is
``If-None-Match: *`` (the manifest that commits a step, the writer lease), a takeover of a stale lease
``If-Match: <its ETag>``.

Credentials are read as Azure's own tools read them (:func:`~._client.client`): ``AZURE_STORAGE_CONNECTION_STRING``;
or the account (``AZURE_STORAGE_ACCOUNT_NAME`` or ``AZURE_STORAGE_ACCOUNT_URL``) with ``AZURE_STORAGE_ACCOUNT_KEY`` or
``AZURE_STORAGE_SAS_TOKEN``; or the account alone (in the settings or the location) with ``DefaultAzureCredential``
(``azure-identity``, part of the ``azure`` extra).
Every request is bounded in time and retried on transient errors (:data:`~._client.RETRIES`); a failure is raised
naming the blob and the server's error.
"""

from __future__ import annotations

from ..objstore import ObjectStorage
from ._client import SCHEMES, AbfsPath, AzPath, AzureError, AzurePreconditionFailed, client, parse_az_url
from .bucket import AzureBucket, AzureWriteStream

__all__ = ["AzureStorage", "AzureBucket", "AzureWriteStream", "AzureError", "AzurePreconditionFailed", "AzPath",
           "AbfsPath", "SCHEMES", "client", "parse_az_url"]


class AzureStorage(ObjectStorage):
    """A checkpoint folder in an Azure blob container, ``az://container/prefix`` or ``abfs://container/prefix`` (see
    :class:`~ckptio.storage.objstore.ObjectStorage`)."""

    def __init__(self, url: str) -> None:
        scheme, container, prefix = parse_az_url(url)
        super().__init__(AzureBucket(container, scheme), prefix)

    def check_writable(self) -> None:
        """The container must exist (ckptio never creates one); one that cannot be looked up (no permission to read
        its properties, no connection) is left to the requests that follow, which name what they met."""
        try:
            exists = self.store.exists()  # type: ignore[attr-defined]
        except AzureError:
            return
        if not exists:
            container = self.store.container  # type: ignore[attr-defined]
            raise AzureError(f"{self.root}: the container {container!r} does not exist; ckptio saves into an "
                             f"existing container and never creates one: create it first (az storage container "
                             f"create --name {container}), or check its name and the storage account")
