"""Uploading to GCS from memory as the bytes are written (:class:`~ckptio.storage.objstore.upload.PartStream`): an
object that stays within one part goes up in one request, a larger one as a resumable upload session fed a part at a
time (GCS takes a session's bytes in order only: one part in flight). A part whose request fails is sent again, from
where the server's last answer said it had the bytes, for up to :data:`~._client.DEADLINE` seconds (bytes a server
took twice would not match the object's CRC-32C, checked at the end).

Checked: the object's CRC-32C as GCS computed it, in its answer to the last request, must be the CRC-32C of the
bytes handed to the client (the stream's running CRC-32C, which the manifest records); the last request also names
it (``X-Goog-Hash``; an object of one request: its metadata's ``crc32c``), which GCS checks before it makes the
object. An object that does not match is removed and the save fails naming it."""

from __future__ import annotations

import base64
import json
import secrets
import time
from typing import Any, Sequence

from ..objstore.upload import Body, Parts, after, nbytes
from ._client import DEADLINE, GCSError, client, objects_url, request, timeout

PART = 100 << 20
"""Bytes a request of a resumable upload carries (GCS: a multiple of 256 KiB): the client's own chunk of a resumable
upload (``google.cloud.storage.blob._DEFAULT_CHUNKSIZE``), so a file up to it is one request. Each request (the part
handed to a thread, sent, its answer read) cost ~2-3 ms of CPU here: at 16 MiB, ~0.15 CPU-s/GB of a save."""
JOIN = 1 << 20
"""Bytes of an object up to which its one-request upload's body is joined into one buffer (one copy, one send)."""
OCTETS = "application/octet-stream"
_TRANSIENT = frozenset({408, 429, 500, 502, 503, 504})


def _b64(crc: int) -> str:
    """A CRC-32C as GCS writes it (base64 of its 4 big-endian bytes)."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class GCSParts(Parts):
    """One object of a GCS bucket, uploaded part by part (see the module)."""

    threads = 1

    def __init__(self, bucket: Any, key: str) -> None:
        self.bucket, self.key, self.where = bucket, key, bucket.path(key)
        self.part_size = PART
        self.session: str | None = None

    def single(self, pieces: Sequence[memoryview], crc: int) -> None:
        """The whole object in one request (:func:`upload_whole`)."""
        upload_whole(self.bucket, self.key, pieces, crc)

    def send(self, number: int, offset: int, pieces: Sequence[memoryview], crc: int) -> None:
        if self.session is None:  # a resumable upload session: its URL comes in the answer's Location
            self.session = request("starting the upload of", self.where, "POST",
                                   objects_url(self.bucket.name, api="upload") + "?uploadType=resumable",
                                   data=json.dumps({"name": self.key, "contentType": OCTETS}).encode(),
                                   headers={"Content-Type": "application/json; charset=UTF-8",
                                            "X-Upload-Content-Type": OCTETS},
                                   read=lambda answer: answer.headers["Location"])
        self._put(number, offset, pieces, None, None)

    def finish(self, number: int, offset: int, pieces: Sequence[memoryview], crc: int, size: int,
               total_crc: int) -> None:
        answer = self._put(number, offset, pieces, size, total_crc)
        _check(self.bucket, self.key, answer, size, total_crc)

    def _put(self, number: int, offset: int, pieces: Sequence[memoryview], total: int | None,
             crc: int | None) -> dict[str, Any]:
        """PUT ``pieces`` at ``offset`` of the session (``total``: the object's size, on the last request), sending
        again what the server did not take; the server's JSON answer once the object is made, else ``{}``. Every
        part but the last is :data:`PART` bytes (a multiple of 256 KiB, as GCS wants every request but the last)."""
        from requests import RequestException

        assert self.session is not None
        http, end = client()._http, offset + nbytes(pieces)
        deadline, delay, done = time.monotonic() + DEADLINE, 0.5, 0
        what = f"uploading part {number + 1} of"
        while True:
            rest = end - offset - done
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(rest),
                       "Content-Range": f"bytes {offset + done}-{end - 1}/{total if total is not None else '*'}"
                       if rest else f"bytes */{total}"}
            if crc is not None:
                headers["X-Goog-Hash"] = f"crc32c={_b64(crc)}"
            try:  # the part's pieces from their own memory, from where the server's answer said it has them
                answer = http.request("PUT", self.session, data=Body(after(pieces, done)) if rest else b"",
                                      headers=headers, timeout=timeout())
                failure = ""
            except (RequestException, ConnectionError, TimeoutError) as exc:
                answer, failure = None, f"{type(exc).__name__}: {exc}"
            if answer is not None:
                if answer.status_code in (200, 201):
                    return answer.json()
                if answer.status_code == 308:
                    have = _persisted(answer)
                    if have == end and total is None:
                        return {}
                    if not offset <= have <= end:
                        raise GCSError(f"{what} {self.where} failed: the server has {have} bytes of the upload, "
                                       f"this part is bytes {offset} to {end}")
                    if have > offset + done:  # part of the request went in: the rest is sent again at once
                        done = have - offset
                        continue
                    failure = f"308 with no progress (the server has {have} bytes)"
                else:
                    failure = f"{answer.status_code} {answer.text[:300]}"
                    if answer.status_code not in _TRANSIENT:
                        raise GCSError(f"{what} {self.where} failed: {failure}")
            if time.monotonic() + delay > deadline:
                raise GCSError(f"{what} {self.where} failed after {DEADLINE:.0f} s of retries: {failure}")
            time.sleep(delay)  # then the rest of the part again: the server says what it has in its answer (308)
            delay = min(2 * delay, 8.0)

    def abort(self) -> None:
        if self.session is None:
            return
        try:  # a resumable session is cancelled by a DELETE of its URL (it would expire in a week anyway)
            client()._http.request("DELETE", self.session, timeout=timeout())
        except Exception:  # noqa: BLE001
            pass


def upload_whole(bucket: Any, key: str, pieces: Sequence[Any], crc: int, *, if_generation_match: int | None = None,
                 what: str = "uploading") -> None:
    """One multipart request making the object ``key`` of ``pieces`` (bytes-like, one after another, whose CRC-32C
    is ``crc``): its metadata, naming that CRC-32C (GCS makes no object whose bytes do not match it), then the
    pieces, sent from their own memory (the client's ``upload_from_file`` copied the bytes into a ``BytesIO``, read
    them out again and joined them into its body: three copies, on pages never touched before);
    ``if_generation_match``: made only over that generation (0: only where there is none). Retried whole, as the
    client's requests are (:func:`~._client.request`); the object GCS answers with must be those bytes (their CRC-32C
    and size), else it is removed and the write fails."""
    where = bucket.path(key)
    url = objects_url(bucket.name, api="upload") + "?uploadType=multipart"
    if if_generation_match is not None:
        url += f"&ifGenerationMatch={int(if_generation_match)}"
    boundary = f"==ckptio{secrets.token_hex(16)}=="
    meta = json.dumps({"name": key, "contentType": OCTETS, "crc32c": _b64(crc)})
    head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{meta}\r\n--{boundary}\r\n"
            f"Content-Type: {OCTETS}\r\n\r\n").encode()
    size = nbytes(pieces)
    whole = (head, *pieces, f"\r\n--{boundary}--\r\n".encode())
    # a small body joined (one send: each send on a loopback or local connection costs a system call and the
    # kernel's work), a large one sent from its pieces' own memory
    body: Any = b"".join(whole) if size <= JOIN else Body(whole)
    made = request(what, where, "POST", url, data=body,
                   headers={"Content-Type": f'multipart/related; boundary="{boundary}"'}, read=_json)
    _check(bucket, key, made, size, crc)


def _check(bucket: Any, key: str, answer: dict[str, Any], want_size: int, crc: int) -> None:
    """The object GCS made (its JSON resource, ``answer``) must be the bytes sent: their CRC-32C and size; else that
    version of it is removed."""
    theirs, size, generation = answer.get("crc32c"), answer.get("size"), answer.get("generation")
    if theirs == _b64(crc) and size is not None and int(size) == want_size:
        return
    where = bucket.path(key)
    try:
        request("removing", where, "DELETE", objects_url(bucket.name, key), ok=(200, 204),
                params={"generation": int(generation)} if generation else None)
    except Exception:  # noqa: BLE001 - a step's objects go with it when the failed save is cleaned up
        pass
    raise GCSError(f"uploading {where} failed: the object GCS made ({size} bytes, CRC-32C {theirs}) is not "
                   f"what was sent ({want_size} bytes, CRC-32C {_b64(crc)}): damaged on the way; removed")


def _json(answer: Any) -> dict[str, Any]:
    return answer.json()


def _persisted(answer: Any) -> int:
    """The bytes a session holds, from a ``308``'s ``Range: bytes=0-N`` (none: 0)."""
    value = answer.headers.get("Range", "")
    return int(value.rpartition("-")[2]) + 1 if value.startswith("bytes=") else 0
