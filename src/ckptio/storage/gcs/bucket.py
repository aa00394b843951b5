"""A Google Cloud Storage bucket, as the object-store folder needs it (:class:`~ckptio.storage.objstore._store.Bucket`):
a create-only write is ``ifGenerationMatch=0``, a replacement of one version ``ifGenerationMatch=<generation>``.

Each operation a save or a restore uses is one request of GCS's JSON API sent through ``google-cloud-storage``'s own
authorized session, with its retry policy (:func:`~._client.request`); a server-side copy and a file larger than one
part go through the client's own calls."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

from crc32c import crc32c

from ...errors import CheckpointNotFoundError
from ..objstore._store import Bucket, Obj, fill
from ..objstore.upload import PartStream
from ._client import DELETE_THREADS, GCSError, GSPath, _call, client, objects_url, request, retry, timeout
from .upload import PART, GCSParts, _json, upload_whole

LIST_PAGE = 1000
"""Objects a listing asks for a page (the JSON API's most)."""
_FIELDS = "name,size,updated,generation"
_LISTED = f"items({_FIELDS}),prefixes,nextPageToken"


class GCSBucket(Bucket):
    """One GCS bucket (credentials: the application default credentials, or an emulator's endpoint)."""

    path_type = GSPath

    def _bucket(self) -> Any:
        return client().bucket(self.name)

    def listing(self, prefix: str, *, delimiter: bool) -> tuple[list[Obj], list[str]]:
        """The JSON API's listing, page by page (each page's request retried on its own), asked for only the fields
        an :class:`Obj` holds."""
        url, where = objects_url(self.name), self.path(prefix)
        params = {"prefix": prefix, "maxResults": LIST_PAGE, "fields": _LISTED}
        if delimiter:
            params["delimiter"] = "/"
        objects: list[Obj] = []
        prefixes: set[str] = set()
        while True:
            page = request("listing", where, "GET", url, params=params, read=_json)
            objects += [_obj(item, where) for item in page.get("items", ())]
            prefixes.update(page.get("prefixes", ()))
            if not page.get("nextPageToken"):
                return objects, sorted(prefixes)
            params["pageToken"] = page["nextPageToken"]

    def head(self, key: str) -> Obj | None:
        try:
            item = request("looking up", self.path(key), "GET", objects_url(self.name, key),
                           params={"fields": _FIELDS}, read=_json)
        except CheckpointNotFoundError:
            return None
        return _obj(item, self.path(key))

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_token: Any = None) -> None:
        upload_whole(self, key, (data,), crc32c(data), if_generation_match=0 if if_absent else if_token, what="writing")

    def get(self, key: str, limit: int) -> tuple[bytes, Any]:
        """One ranged ``GET`` of the object's media: its first ``limit`` bytes and, in the answer's
        ``X-Goog-Generation``, the generation they are of (as the client reads it after a download)."""
        def read(answer: Any) -> tuple[bytes, Any]:  # no more than ``limit`` bytes, whatever the server sends
            data = b"" if answer.status_code == 416 else answer.raw.read(limit, decode_content=False)
            return data, answer.headers.get("X-Goog-Generation")

        data, generation = request("reading", self.path(key), "GET", objects_url(self.name, key, api="download"),
                                   params={"alt": "media"}, headers={"Range": f"bytes=0-{max(limit, 1) - 1}"},
                                   stream=True, ok=(200, 206, 416), read=read)  # 416: an empty object has no byte 0
        if generation is None:  # a server that does not say: the version looked up, then its bytes
            return self._get_pinned(key, limit)
        return data, int(generation)

    def _get_pinned(self, key: str, limit: int) -> tuple[bytes, Any]:
        where = self.path(key)
        found = self.head(key)
        if found is None:
            raise CheckpointNotFoundError(f"{where}: missing (404)")
        size = min(found.size, limit)
        if size == 0:
            return b"", found.token
        data = request("reading", where, "GET", objects_url(self.name, key, api="download"),
                       params={"alt": "media", "generation": found.token}, headers={"Range": f"bytes=0-{size - 1}"},
                       ok=(200, 206)).content[:size]
        return data, found.token

    def read_into(self, key: str, offset: int, view: memoryview) -> int:
        """One ranged ``GET`` of the object's media, its body read straight into ``view`` (:func:`fill`): the
        client's ``download_to_file`` hands its sink the body 8 KB at a time, one Python write each (~17,000 for a
        140 MB file). Retried whole, as the client's requests are (:func:`~._client.request`)."""
        n = view.nbytes
        if n == 0:
            return 0
        from google.api_core.exceptions import from_http_response

        def read(response: Any) -> int:
            if response.status_code == 200 and offset:
                raise from_http_response(response)  # 200 from byte 0 for a range further on: not what was asked
            return fill(lambda k: response.raw.read(k, decode_content=False), view)

        return request("reading", self.path(key), "GET", objects_url(self.name, key, api="download") + "?alt=media",
                       headers={"Range": f"bytes={offset}-{offset + n - 1}"}, stream=True, ok=(200, 206), read=read)

    def delete(self, key: str) -> None:
        try:
            request("removing", self.path(key), "DELETE", objects_url(self.name, key), ok=(200, 204))
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
        """A file within one part (:data:`~.upload.PART`) in one request from its bytes (:func:`upload_whole`), a
        larger one by the client's resumable upload (which checks its CRC-32C)."""
        if path.stat().st_size <= PART:
            data = path.read_bytes()
            upload_whole(self, key, (data,), crc32c(data), if_generation_match=0 if if_absent else None)
            return
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


def _obj(item: dict[str, Any], where: object) -> Obj:
    """An object resource of the JSON API (its fields :data:`_FIELDS`) as an :class:`Obj`."""
    try:
        return Obj(item["name"], int(item.get("size") or 0), datetime.fromisoformat(item["updated"]).timestamp(),
                   int(item["generation"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise GCSError(f"{where}: the server described an object as {item!r}, not as GCS does "
                       f"({type(exc).__name__}: {exc})") from None
