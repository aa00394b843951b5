"""An Azure Blob Storage container through ``azure-storage-blob``, as the object-store folder needs it
(:class:`~ckptio.storage.objstore._store.Bucket`): a create-only write is ``If-None-Match: *`` (refused with
``409 BlobAlreadyExists``), a replacement of one version ``If-Match: <its ETag>`` (refused with ``412``)."""

from __future__ import annotations

import functools
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from ...errors import CheckpointNotFoundError
from ..objstore._store import Bucket, Obj
from ..objstore.upload import Body, Parts, PartStream
from . import _client
from ._client import THREADS, AbfsPath, AzPath, AzureError, _call, client, split_account
from . import _request
from .download import read_range

COPY_POLL_S = 0.2
"""Seconds between looks at a server-side copy the service finishes in the background (``x-ms-copy-status: pending``)."""


def _conditions(if_absent: bool, if_token: Any) -> dict[str, Any]:
    from azure.core import MatchConditions

    if if_absent:
        return {"match_condition": MatchConditions.IfMissing}  # If-None-Match: *
    if if_token is not None:
        return {"etag": if_token, "match_condition": MatchConditions.IfNotModified}  # If-Match: <etag>
    return {}


def _condition_headers(if_absent: bool, if_token: Any) -> dict[str, str]:
    """The same conditions as headers (:mod:`._request`)."""
    if if_absent:
        return {"If-None-Match": "*"}
    return {} if if_token is None else {"If-Match": if_token}


class AzureBucket(Bucket):
    """One blob container (the account and credentials: :func:`~._client.client`; the account may be named in the
    location, ``container@account.dfs.core.windows.net``), shown as ``az://`` or ``abfs://`` as it was given."""

    path_type = AzPath

    def __init__(self, name: str, scheme: str = "az") -> None:
        super().__init__(name)  # as given: "container", or "container@account.dfs.core.windows.net"
        self.path_type = AbfsPath if scheme == "abfs" else AzPath
        self.container, self.account = split_account(name)
        self._made: tuple[Any, Any] = (None, None)

    def _container(self) -> Any:
        """The ``ContainerClient`` of the current :func:`~._client.client` (made again when that is a new one)."""
        service = client(self.account)
        if self._made[0] is not service:
            self._made = (service, service.get_container_client(self.container))
        return self._made[1]

    def _blob(self, key: str) -> Any:
        return client(self.account).get_blob_client(self.container, key)

    def exists(self) -> bool:
        """Whether the container exists (:func:`._request.container_exists`)."""
        return _call("looking up", self.path(), _request.container_exists, self._container())

    def listing(self, prefix: str, *, delimiter: bool) -> tuple[list[Obj], list[str]]:
        """One ``List Blobs`` a page (:func:`._request.listing`)."""
        found, prefixes = _call("listing", self.path(prefix), _request.listing, self._container(), prefix, delimiter)
        return [Obj(*blob) for blob in found], sorted(prefixes)

    def head(self, key: str) -> Obj | None:
        try:
            size, modified, etag = _call("looking up", self.path(key), _request.properties, self._container(), key)
        except CheckpointNotFoundError:
            return None
        return Obj(key, size, modified, etag)

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_token: Any = None) -> None:
        _call("writing", self.path(key), _request.put, self._container(), key, (data,),
              _condition_headers(if_absent, if_token))

    def get(self, key: str, limit: int) -> tuple[bytes, Any]:
        """One ranged ``GET`` (:func:`._request.get`)."""
        return _call("reading", self.path(key), _request.get, self._container(), key, limit)

    def read_into(self, key: str, offset: int, view: memoryview) -> int:
        """One ranged ``GET``, its body read into ``view`` (:func:`~.download.read_range`)."""
        if view.nbytes == 0:
            return 0
        return read_range(self._container(), key, self.path(key), offset, view)

    def delete(self, key: str) -> None:
        try:
            _call("removing", self.path(key), _request.delete, self._container(), key)
        except CheckpointNotFoundError:
            pass  # gone already: what was asked

    def delete_many(self, keys: list[str], where: object) -> None:
        with ThreadPoolExecutor(min(THREADS, len(keys)) or 1, thread_name_prefix="ckptio-az-delete") as pool:
            for done in [pool.submit(self.delete, key) for key in keys]:
                done.result()

    def copy(self, src: str, dst: str) -> None:
        where, target = self.path(src), self._blob(dst)
        # within one account the service copies without the bytes passing through here; a large blob's copy may
        # finish in the background ('pending'), looked at until it is done
        status = _call("copying", where, target.start_copy_from_url, self._blob(src).url).get("copy_status")
        while status == "pending":
            time.sleep(COPY_POLL_S)
            status = _call("copying", where, target.get_blob_properties).copy.status
        if status != "success":
            raise AzureError(f"copying {where} to {self.path(dst)} failed: the copy ended {status!r}")

    def upload_file(self, path: Path, key: str, *, if_absent: bool = False) -> None:
        size = path.stat().st_size
        if size <= _client.SINGLE_PUT:  # one Put Blob, as the client sends it, with no BlobClient (:mod:`._request`)
            data = path.read_bytes()
            _call("uploading", self.path(key), _request.put, self._container(), key, (data,),
                  _condition_headers(if_absent, None))
            return
        with open(path, "rb") as f:
            # above SINGLE_PUT the client sends 4 MiB blocks, THREADS at once, and commits the block list with the
            # condition (If-None-Match: * on the list: a second writer's commit is refused the same way)
            _call("uploading", self.path(key), self._blob(key).upload_blob, f, length=size, overwrite=True,
                  max_concurrency=THREADS, **_conditions(if_absent, None))

    spools = False

    def open_stream(self, spool: Path | None, key: str) -> "AzureWriteStream":
        return AzureWriteStream(self, key)


class AzureWriteStream(PartStream):
    """A new blob uploaded from memory as it is written: a blob within :data:`~._client.SINGLE_PUT` in one request at
    :meth:`close` (as ``upload_blob`` sends it); a larger one in a first block of that size, then blocks of
    :data:`~._client.UPLOAD_BLOCK`, staged :data:`~._client.UPLOAD_THREADS` at once and committed by their list at
    :meth:`close`; no local spool."""

    def __init__(self, bucket: AzureBucket, key: str) -> None:
        super().__init__(_Blocks(bucket, key), bucket.path(key))


class _Blocks(Parts):
    """One blob uploaded block by block (``stage_block``, retried by the client's policy; ``commit_block_list``).
    A block goes up with no checksum of its own: Azure checks only MD5 (~1.3 CPU-s/GB here, twice the whole raw
    upload) or a CRC-64 the client computes with an optional extension; the bytes sent are the part's pieces whose
    CRC-32C the manifest records, so a restore checks them (and the connection's TLS, those in transit)."""

    def __init__(self, bucket: AzureBucket, key: str) -> None:
        self.threads = _client.UPLOAD_THREADS
        self.bucket, self.key, self.where = bucket, key, bucket.path(key)
        self.part_size, self.first_size = _client.UPLOAD_BLOCK, _client.SINGLE_PUT
        self.prefix = uuid.uuid4().hex[:16]  # the ids of one upload's blocks (all of one length, as Azure wants)

    @functools.cached_property
    def blob(self) -> Any:
        """The ``BlobClient`` of a blob sent in blocks (one sent whole needs none: :meth:`single`)."""
        return self.bucket._blob(self.key)

    def _id(self, number: int) -> str:
        return f"{self.prefix}{number:08d}"

    def send(self, number: int, offset: int, pieces: Sequence[memoryview], crc: int) -> None:
        """``Put Block`` of the part's pieces as one body from their own memory (:class:`Body`: the client's request
        takes an iterable body as it is)."""
        body = Body(pieces)
        _call(f"uploading block {number + 1} of", self.where, self.blob.stage_block, self._id(number), body,
              length=body.size)

    def finish(self, number: int, offset: int, pieces: Sequence[memoryview], crc: int, size: int,
               total_crc: int) -> None:
        if any(p.nbytes for p in pieces):
            self.send(number, offset, pieces, crc)
            number += 1
        _call("committing the blocks of", self.where, self.blob.commit_block_list,
              [self._id(n) for n in range(number)])

    def single(self, pieces: Sequence[memoryview], crc: int) -> None:
        """``Put Blob`` of the part's pieces from their own memory (``upload_blob`` takes only ``bytes``: a copy of up
        to 64 MiB, a new mapping of memory at every file, ~1 CPU-s/GB here); retried by the client's policy, which
        sends them again (:func:`._request.put`)."""
        _call("uploading", self.where, _request.put, self.bucket._container(), self.key, pieces, {})
