"""A Google Cloud Storage bucket through ``google-cloud-storage``, as the object-store folder needs it
(:class:`~ckptio.storage.objstore._store.Bucket`): a create-only write is ``ifGenerationMatch=0``, a replacement of
one version ``ifGenerationMatch=<generation>``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ...errors import CheckpointNotFoundError
from ..objstore._store import Bucket, Obj, fill
from ..objstore.upload import PartStream
from ._client import DELETE_THREADS, GSPath, _call, client, retry, timeout
from .upload import GCSParts


class GCSBucket(Bucket):
    """One GCS bucket (credentials: the application default credentials, or an emulator's endpoint)."""

    path_type = GSPath

    def _bucket(self) -> Any:
        return client().bucket(self.name)

    def listing(self, prefix: str, *, delimiter: bool) -> tuple[list[Obj], list[str]]:
        def run() -> tuple[list[Obj], list[str]]:
            it = client().list_blobs(self.name, prefix=prefix, delimiter="/" if delimiter else None, timeout=timeout(),
                                     retry=retry())
            objects = [Obj(b.name, int(b.size or 0), b.updated.timestamp(), b.generation) for b in it]
            return objects, sorted(it.prefixes)

        return _call("listing", self.path(prefix), run)

    def head(self, key: str) -> Obj | None:
        blob = _call("looking up", self.path(key), self._bucket().get_blob, key, timeout=timeout(), retry=retry())
        return None if blob is None else Obj(key, int(blob.size or 0), blob.updated.timestamp(), blob.generation)

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_token: Any = None) -> None:
        blob = self._bucket().blob(key)
        _call("writing", self.path(key), blob.upload_from_string, data, content_type="application/octet-stream",
              if_generation_match=0 if if_absent else if_token, timeout=timeout(), retry=retry())

    def get(self, key: str, limit: int) -> tuple[bytes, Any]:
        where = self.path(key)
        blob = _call("looking up", where, self._bucket().get_blob, key, timeout=timeout(), retry=retry())
        if blob is None:
            raise CheckpointNotFoundError(f"{where}: missing (404)")
        size = min(int(blob.size or 0), limit)
        if size == 0:
            return b"", blob.generation
        pinned = self._bucket().blob(key, generation=blob.generation)  # the bytes of the version looked up
        data = _call("reading", where, pinned.download_as_bytes, start=0, end=size - 1, raw_download=True,
                     checksum=None, timeout=timeout(), retry=retry())
        return data, blob.generation

    def read_into(self, key: str, offset: int, view: memoryview) -> int:
        """One ranged ``GET`` of the object's media, its body read straight into ``view`` (:func:`fill`): the
        client's ``download_to_file`` hands its sink the body 8 KB at a time, one Python write each (~17,000 for a
        140 MB file). Retried whole, as the client's requests are (:func:`~._client.retry`)."""
        n = view.nbytes
        if n == 0:
            return 0
        from google.api_core.exceptions import from_http_response

        gcs = client()
        url = f"{gcs.api_endpoint}/download/storage/v1{self._bucket().blob(key).path}?alt=media"
        headers = {"Range": f"bytes={offset}-{offset + n - 1}"}

        def run() -> int:
            with gcs._http.request("GET", url, headers=headers, stream=True, timeout=timeout()) as response:
                if response.status_code not in (200, 206) or response.status_code == 200 and offset:
                    raise from_http_response(response)  # 200 from byte 0 for a range further on: not what was asked
                return fill(lambda k: response.raw.read(k, decode_content=False), view)

        return _call("reading", self.path(key), retry()(run))

    def delete(self, key: str) -> None:
        try:
            _call("removing", self.path(key), self._bucket().blob(key).delete, timeout=timeout(), retry=retry())
        except CheckpointNotFoundError:
            pass  # gone already: what was asked

    def delete_many(self, keys: list[str], where: object) -> None:
        with ThreadPoolExecutor(min(DELETE_THREADS, len(keys)) or 1, thread_name_prefix="ckptio-gcs-delete") as pool:
            for done in [pool.submit(self.delete, key) for key in keys]:
                done.result()

    def copy(self, src: str, dst: str) -> None:
        bucket = self._bucket()
        source, target = bucket.blob(src), bucket.blob(dst)
        token = None
        while True:  # a rewrite of a large object goes in several calls, each naming where the last stopped
            token, _, _ = _call("copying", self.path(src), target.rewrite, source, token=token, timeout=timeout(),
                                retry=retry())
            if token is None:
                return

    def upload_file(self, path: Path, key: str, *, if_absent: bool = False) -> None:
        blob = self._bucket().blob(key)
        _call("uploading", self.path(key), blob.upload_from_filename, str(path),
              content_type="application/octet-stream", if_generation_match=0 if if_absent else None, timeout=timeout(),
              retry=retry())

    spools = False

    def open_stream(self, spool: Path | None, key: str) -> "GCSWriteStream":
        return GCSWriteStream(self, key)


class GCSWriteStream(PartStream):
    """A new object uploaded from memory as it is written, checked against its CRC-32C (see :mod:`.upload`); no
    local spool."""

    def __init__(self, bucket: GCSBucket, key: str) -> None:
        super().__init__(GCSParts(bucket, key), bucket.path(key))
