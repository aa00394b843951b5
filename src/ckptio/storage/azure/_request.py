"""A save's and a folder's requests (``Put Blob`` of a small object, of a local file or of a part, ``Delete Blob``,
``Get Blob Properties``, a ranged ``Get Blob``, ``List Blobs``, ``Get Container Properties``) sent as plain HTTP
requests through the client's own pipeline.

Measured on Azurite (CPU per call, 200 calls each, alternating): through ``BlobClient`` a put, removal, lookup or
read cost 1.5-2.1 ms, here 0.9-1.2 ms: per blob a new ``BlobClient`` and its generated client (a serializer of
every model), the generated operation building the request and parsing every answer header into a model, the
tracing decorators. A listing of 40 blobs cost 10-11 ms (the generated XML models, ~0.25 ms a blob), here ~2 ms.
The request is made by hand and run by ``ContainerClient._pipeline``, the pipeline every call of the client runs
(its credentials: shared key, SAS in the URL, token; the retries on 408, 5xx and dropped connections; its
timeouts, proxies, request ids and logging), as :mod:`.download` does for large reads; an answer other than the
expected one is raised as the client raises it (``ResourceNotFoundError`` for 404, else ``HttpResponseError``,
with the service's error code), for :func:`~._client._call` to map as every other call's.
"""

from __future__ import annotations

import re
from email.utils import parsedate_to_datetime
from typing import Any, Sequence
from urllib.parse import quote, unquote

from ..objstore.upload import Body
from ._client import AzureError

PAGE = 5000
"""Names a page of a listing holds at most (``maxresults``; the service's own limit)."""
_CODE = re.compile(rb"<Code>([^<]{1,200})</Code>")


def _query(container: Any, **params: str) -> str:
    """``container``'s URL with ``params`` (quoted whole), then the credentials' query (a SAS token, if any)."""
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in params.items())
    sas = container._query_str.lstrip("?")
    name = quote(container.container_name.encode("utf-8"))
    return f"{container.scheme}://{container.primary_hostname}/{name}?{query}{'&' if sas else ''}{sas}"


def blob_url(container: Any, key: str) -> str:
    """The URL of blob ``key`` in ``container`` (a ``ContainerClient``), as ``BlobClient`` makes it: the container
    and the name quoted (``/`` and ``~`` kept), then the credentials' query (a SAS token, else nothing)."""
    name = quote(container.container_name.encode("utf-8"))
    return f"{container.scheme}://{container.primary_hostname}/{name}/{quote(key, safe='~/')}{container._query_str}"


def send(container: Any, method: str, key: str | None, expect: int | tuple[int, ...],
         headers: dict[str, str] | None = None, body: Any = None, url: str | None = None,
         stream: bool = False) -> Any:
    """Run ``method`` on blob ``key`` (or at ``url``) through ``container``'s pipeline; its answer (status
    ``expect``), else the client's exception for the answer. With ``stream`` the answer's body is left unread for
    the caller (:mod:`.download`); a refused answer's body is read (its error code; the connection is free again)."""
    from azure.core.rest import HttpRequest

    headers = {"x-ms-version": container.api_version, **(headers or {})}
    request = HttpRequest(method, url or blob_url(container, key or ""), headers=headers, content=body)
    # ``stream`` only when wanted: the pipeline's content decoding skips an answer whose context has no ``stream``,
    # and one with ``stream=False`` would be parsed by its content type (a blob's bytes refused as undecodable)
    response = container._pipeline.run(request, **({"stream": True} if stream else {})).http_response
    if response.status_code != expect and not (isinstance(expect, tuple) and response.status_code in expect):
        if stream:
            try:
                response.read()
            finally:
                response.close()
        raise error(response)
    return response


def error(response: Any) -> Exception:
    """The client's exception for an answer it refused: ``ResourceNotFoundError`` (404) or ``HttpResponseError``, its
    ``error_code`` the service's ``x-ms-error-code``, else the ``<Code>`` of the answer's body, as the client reads
    it (a ``HEAD``'s answer has no body: its header alone tells)."""
    from azure.core.exceptions import HttpResponseError, ResourceNotFoundError

    exc = (ResourceNotFoundError if response.status_code == 404 else HttpResponseError)(response=response)
    code = response.headers.get("x-ms-error-code")
    if not code:
        found = _CODE.search(response.body() or b"")
        code = found and found[1].decode("utf-8", "replace")
    exc.error_code = code  # type: ignore[attr-defined]
    return exc


def put(container: Any, key: str, pieces: Sequence[Any], conditions: dict[str, str]) -> None:
    """``Put Blob`` of ``pieces`` (bytes-like, one after another, sent from their own memory as one body: see
    :class:`~..objstore.upload.Body`; again whole if retried) as a block blob, with ``conditions``
    (``If-None-Match: *``, ``If-Match: <ETag>``)."""
    body = Body(pieces)
    headers = {"x-ms-blob-type": "BlockBlob", "Content-Length": str(body.size), **conditions}
    send(container, "PUT", key, 201, headers, body if body.size else b"")


def container_exists(container: Any) -> bool:
    """Whether ``container`` exists: ``Get Container Properties`` (a ``HEAD``) answered 200, not 404."""
    from azure.core.exceptions import ResourceNotFoundError

    try:
        send(container, "HEAD", None, 200, url=_query(container, restype="container"))
    except ResourceNotFoundError:
        return False
    return True


def delete(container: Any, key: str) -> None:
    send(container, "DELETE", key, 202)


def properties(container: Any, key: str) -> tuple[int, float, str]:
    """(size, last modified as a POSIX time, ETag) of blob ``key``."""
    headers = send(container, "HEAD", key, 200).headers
    modified = parsedate_to_datetime(headers["Last-Modified"]).timestamp()
    return int(headers["Content-Length"]), modified, headers["ETag"]


def get(container: Any, key: str, limit: int) -> tuple[bytes, str]:
    """The first ``limit`` bytes of blob ``key`` (all of a smaller one) and the ETag of the version they are of: one
    ranged ``GET`` (an empty blob, which has no byte 0 to range over, answers 416: then one plain ``GET``)."""
    from azure.core.exceptions import HttpResponseError

    try:
        response = send(container, "GET", key, (200, 206), {"x-ms-range": f"bytes=0-{max(limit, 1) - 1}"})
    except HttpResponseError as exc:
        if exc.status_code != 416:
            raise
        response = send(container, "GET", key, 200)
    return response.body()[:limit], response.headers["ETag"]


def listing(container: Any, prefix: str, delimiter: bool) -> tuple[list[tuple[str, int, float, str]], list[str]]:
    """``List Blobs`` of the names from ``prefix`` (up to the next ``/`` after it, with ``delimiter``), page by page:
    ([(name, size, last modified, ETag as a lookup gives it)], [the prefixes ending at a ``/``]). The answer's XML
    is read for these four fields alone: the client's generated models took ~0.25 ms of CPU per blob listed
    (reading every property of every blob into a model, then into ``BlobProperties``)."""
    import xml.etree.ElementTree as ET

    blobs, prefixes, marker = [], [], ""
    while True:
        params = {"restype": "container", "comp": "list", "prefix": prefix, "maxresults": str(PAGE)}
        if delimiter:
            params["delimiter"] = "/"
        if marker:
            params["marker"] = marker
        body = send(container, "GET", None, 200, url=_query(container, **params)).body()
        try:
            root = ET.fromstring(body)
        except ET.ParseError as exc:
            raise AzureError(f"listing {prefix!r} of container {container.container_name!r}: the server's answer is "
                             f"not XML ({exc})") from None
        for item in root.iterfind("Blobs/Blob"):
            props = item.find("Properties")
            try:
                assert props is not None, "no <Properties>"
                etag = props.findtext("Etag") or ""
                modified = parsedate_to_datetime(props.findtext("Last-Modified") or "").timestamp()
                size = int(props.findtext("Content-Length") or 0)
            except (AssertionError, TypeError, ValueError) as exc:
                raise AzureError(f"listing {prefix!r} of container {container.container_name!r}: the server "
                                 f"described a blob not as Azure does ({type(exc).__name__}: {exc})") from None
            blobs.append((_name(item), size, modified, etag if not etag or etag.startswith('"') else f'"{etag}"'))
        prefixes += [_name(item) for item in root.iterfind("Blobs/BlobPrefix")]
        marker = root.findtext("NextMarker") or ""
        if not marker:
            return blobs, prefixes


def _name(item: Any) -> str:
    """A listed blob's (or prefix's) name: ``<Name>``, URL-encoded when the service says so (a name holding
    characters XML cannot carry: ``Encoded="true"``)."""
    element = item.find("Name")
    text = element.text or ""
    return unquote(text) if element.get("Encoded") == "true" else text
