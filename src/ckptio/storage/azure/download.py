"""A ranged read of a blob, its body read straight into the reader's buffer.

``download_blob`` fetched a read of 48 MiB as three ranged GETs of :data:`~._client.READ_CHUNK`, each answer's body
taken in 4 MiB ``bytes``, joined into new ``bytes`` of the chunk and copied into the buffer: three copies of every
byte in the client, and per request its stream downloader, the ~25 response headers parsed into a model, and a new
``BlobClient``. Here a read is one ``GET`` with ``x-ms-range`` sent as :mod:`._request` sends a save's requests,
through the container's pipeline (the account's credentials, the retries on 408, 5xx and dropped connections, its
timeouts and proxies; a refused answer raised as every other request's), and its body is read by
the HTTP response into the buffer itself (the socket's bytes copied once, as a raw download's are at best). A body
cut off midway is asked for again from where it stopped, of the same version of the blob (``If-Match``; at most
:data:`~._client.RETRIES` times). Measured on Azurite, a
42 MB read: 1.2 cpu-s/GB with ``download_blob``, 0.35 here (``benchmarks/objstore_cost.py``'s raw download: 2.4).
"""

from __future__ import annotations

from http.client import HTTPException
from typing import Any

from . import _client, _request
from ._client import AzureError, _call


def read_range(container: Any, key: str, where: object, offset: int, view: memoryview) -> int:
    """Read the bytes of blob ``key`` of ``container`` (a ``ContainerClient``) from ``offset`` into ``view``; returns
    how many came (fewer: the blob ends before ``view`` is full). ``where`` names the blob in errors: a missing blob
    is :class:`~ckptio.errors.CheckpointNotFoundError`, any other failure :class:`~._client.AzureError`."""
    n, done, cuts, version = view.nbytes, 0, 0, None
    while done < n:
        response = _call("reading", where, _get, container, key, offset + done, n - done, version)
        version = version or response.headers.get("ETag")  # the rest, if cut: of this version only, or a 412
        got, expected, why = _into(response, view[done:], where, offset + done)
        done += got
        if got == expected:
            return done
        cuts += 1
        if cuts > _client.RETRIES:
            raise AzureError(f"reading {where} failed: the answer was cut off {cuts} times ({why}); {done} of the "
                             f"{n} bytes from byte {offset} were read")
    return done


def _get(container: Any, key: str, start: int, count: int, version: str | None) -> Any:
    """The answer to a ranged ``GET`` of ``count`` bytes from ``start`` (of the blob's ``version``, an ETag, when
    given: ``If-Match``), its body not read yet (:func:`._request.send`, which raises any answer other than 200 or
    206 as the client raises it)."""
    headers = {"x-ms-range": f"bytes={start}-{start + count - 1}"}
    if version:
        headers["If-Match"] = version
    return _request.send(container, "GET", key, (200, 206), headers, stream=True)


def _into(response: Any, view: memoryview, where: object, start: int) -> tuple[int, int, str]:
    """Read ``response``'s body into ``view``: (bytes read, bytes the answer announced (at most ``view``'s), why it
    ended short). The body goes through the HTTP response's ``readinto`` (the socket's ``recv_into`` into ``view``
    for large reads); the connection is kept for the next request once the body is all read, dropped otherwise."""
    headers = response.headers
    begins = headers.get("Content-Range", "bytes 0-").partition(" ")[2].partition("-")[0]
    if response.status_code == 200 and start or response.status_code == 206 and begins != str(start):
        response.close()
        raise AzureError(f"reading {where} failed: asked for the bytes from {start}, the answer holds "
                         f"{headers.get('Content-Range') or 'the whole blob'}")
    expected = min(int(headers.get("Content-Length", 0)), view.nbytes)
    raw = response.internal_response.raw  # urllib3's response: its body not decoded, as the blob's bytes were checked
    body: Any = getattr(raw, "_fp", None)  # the http.client response under it, which reads into a buffer
    readinto = body.readinto if hasattr(body, "readinto") else raw.readinto
    done, why = 0, "the connection closed"
    try:
        while done < expected:
            got = readinto(view[done:expected])
            if not got:
                break
            done += got
    except (OSError, HTTPException) as exc:  # a reset connection, the read timeout
        why = f"{type(exc).__name__}: {_client._first_line(exc)}"
    if done == expected and (body is None or body.isclosed()):
        raw.release_conn()
    else:
        response.close()
    return done, expected, why
