"""What a checkpoint folder in object storage needs from a bucket, whatever the cloud: the :class:`Bucket` interface
each backend implements with its own client (:mod:`ckptio.storage.s3`, :mod:`ckptio.storage.gcs`), the printed
location of an object (:class:`ObjectPath`), the errors every backend raises, and the pieces backends share (a
response body read into a buffer, :func:`fill`; their uploads from memory: :mod:`.upload`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ...engine.manifest import MANIFEST_NAME as MANIFEST  # noqa: F401  (the commit point: written last)
from ...engine.manifest import PENDING_NAME as PENDING  # noqa: F401  (written first, removed after the manifest)
from ...errors import CheckpointError, ConfigError
from ..confined import UnsafePathError, check_relative

LEASE_SECONDS = 120.0
"""A writer lease not renewed for this long belongs to a process that is gone and may be taken over."""
MAX_POINTER_BYTES = 4096


class ObjectStoreError(CheckpointError):
    """A request to the object store failed (after its retries); names the object and the server's answer."""


class PreconditionFailed(ObjectStoreError):
    """A conditional write found the object not as required (a create-only write found one there, a replacement
    found another version): another writer got there first."""


def parse_url(url: str, scheme: str) -> tuple[str, str]:
    """``<scheme>://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; a malformed URL is a :class:`ConfigError`."""
    if not url.startswith(f"{scheme}://"):
        raise ConfigError(f"{url!r} is not an {scheme}:// location")
    bucket, _, prefix = url[len(scheme) + 3:].partition("/")
    prefix = prefix.strip("/")
    if not bucket or "/" in bucket:
        raise ConfigError(f"{url!r}: no bucket name (expected {scheme}://bucket/prefix)")
    if prefix:
        try:
            check_relative(prefix, url)
        except UnsafePathError as exc:
            raise ConfigError(f"{url!r}: the prefix must be plain names separated by '/' ({exc})") from None
    return bucket, prefix


class ObjectPath(PurePosixPath):
    """The name of an object or a prefix, shown as ``<scheme>://bucket/key``. Path arithmetic works as for a
    local path (``/``, ``name``, ``parent``); it is never a local path (``os.fspath`` refuses it)."""

    scheme = "object"

    def __str__(self) -> str:
        return f"{self.scheme}://" + super().__str__()

    def __fspath__(self) -> str:
        raise TypeError(f"{self} is an object-store location, not a local path")

    @property
    def bucket(self) -> str:
        return self.parts[0]

    @property
    def key(self) -> str:
        return "/".join(self.parts[1:])


@dataclass(frozen=True)
class Obj:
    """An object as a listing or a lookup shows it."""

    key: str
    size: int
    mtime: float
    """Seconds since the epoch of its last write."""
    token: Any = None
    """What a conditional replacement of this version names (S3's ETag, GCS's generation); ``None`` if not known."""


class Bucket(ABC):
    """One bucket through one cloud's client. Every method names ``where`` (the printed location) in its errors:
    a missing object is :class:`~ckptio.errors.CheckpointNotFoundError`, a failed condition
    :class:`PreconditionFailed`, any other failure (after the client's retries) an :class:`ObjectStoreError`."""

    path_type: type[ObjectPath] = ObjectPath

    def __init__(self, name: str) -> None:
        self.name = name

    def path(self, key: str = "") -> ObjectPath:
        return self.path_type(self.name, *(p for p in key.split("/") if p))

    @abstractmethod
    def listing(self, prefix: str, *, delimiter: bool) -> tuple[list[Obj], list[str]]:
        """The objects whose key starts with ``prefix`` and, with ``delimiter``, only those directly below it and
        the sub-prefixes (each ending in ``/``) of the rest."""

    @abstractmethod
    def head(self, key: str) -> Obj | None:
        """The object ``key``, ``None`` when there is none."""

    @abstractmethod
    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_token: Any = None) -> None:
        """Write the object whole (readers see the old or the new bytes): create-only with ``if_absent``, only over
        the version ``if_token`` names when that is given."""

    @abstractmethod
    def get(self, key: str, limit: int) -> tuple[bytes, Any]:
        """(the object's first ``limit`` bytes, its :attr:`Obj.token`)."""

    @abstractmethod
    def read_into(self, key: str, offset: int, view: memoryview) -> int:
        """Read the object's bytes from ``offset`` into ``view`` (a ranged request); returns how many came."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; one that is not there is no error."""

    @abstractmethod
    def delete_many(self, keys: list[str], where: object) -> None:
        """Remove the objects (``where``: their common prefix, for the error)."""

    @abstractmethod
    def copy(self, src: str, dst: str) -> None:
        """A server-side copy of any size."""

    @abstractmethod
    def upload_file(self, path: Path, key: str, *, if_absent: bool = False) -> None:
        """Upload a local file as the object ``key`` (create-only with ``if_absent``)."""

    @abstractmethod
    def open_stream(self, spool: Path | None, key: str) -> Any:
        """A :class:`~ckptio.storage.base.WriteStream` that becomes the object ``key`` when it is closed, its bytes
        kept at ``spool`` meanwhile by a bucket that :attr:`spools` (``None`` for one that does not); its ``size``
        is the bytes written (once closed: the object's)."""

    spools = True
    """Whether a stream of :meth:`open_stream` keeps its bytes in a local file (S3's: its parts are read back from
    it), which several threads may also write regions of at once (:mod:`ckptio.storage.regions`); ``False``: the
    stream uploads from memory as it is written, front to back (GCS's and Azure's, :mod:`.upload`)."""

    def sweep_uploads(self, prefix: str, older_than_s: float, now: float) -> list[ObjectPath]:
        """Drop the unfinished uploads below ``prefix`` started at least ``older_than_s`` ago that the store keeps
        (S3's multipart uploads); returns them. Nothing, for a store that keeps none."""
        return []


NET_ENV = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy",
           "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
"""The environment's proxies and CA bundle as ``requests`` reads them: a client that looks them up once
(:func:`environment_network`) keeps these in its cache key, so that a change of them makes a new client."""


def environment_network(url: str) -> tuple[dict[str, str], Any]:
    """(the proxies for ``url``, the CA bundle or ``True``) from the environment (``HTTPS_PROXY``, ``NO_PROXY``...,
    ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``), looked up as ``requests`` does, for a client of one endpoint to use
    at every request. Left to ``requests`` (``trust_env``), each request scans the whole environment and looks for a
    ``.netrc``: ~6% of the client's CPU in a restore (Azure's, GCS's)."""
    import os

    from requests.utils import get_environ_proxies

    return get_environ_proxies(url), os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True


READ_PIECE = 8 << 20
"""Bytes of a response body read at a time into the caller's buffer (:func:`fill`): one Python read and one copy
per piece, where a client's own download hands its file-like sink 8 KB (GCS's) or 256 KB (Azure's) at a time."""


def fill(read: Any, view: memoryview) -> int:
    """Read a response body into ``view`` with ``read(n)`` (a raw stream's: at most ``n`` bytes, ``b""`` at its end),
    :data:`READ_PIECE` at a time; returns how many bytes came (fewer than ``view`` holds: the body ended early)."""
    n, done = view.nbytes, 0
    while done < n:
        piece = read(min(n - done, READ_PIECE))
        if not piece:
            break
        view[done:done + len(piece)] = piece
        done += len(piece)
    return done
