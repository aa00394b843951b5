"""Where bytes go: one storage interface (:mod:`.base`), local POSIX storage (:mod:`.local`), the confined
reader every read goes through (:mod:`.confined`), safe archives and the folder lock."""

import os
import re

from ..errors import ConfigError
from .base import Storage
from .local import LocalFileWriter, LocalFolderWriter, LocalStorage, LocalWriteStream
from .posix import (
    atomic_write_bytes,
    commit_directory,
    fsync_dir,
    fsync_file,
    fsync_tree,
    read_pointer,
    remove_tree,
    write_pointer,
)

__all__ = [
    "LocalStorage",
    "LocalFolderWriter",
    "LocalFileWriter",
    "LocalWriteStream",
    "open_storage",
    "as_storage",
    "url_scheme",
    "atomic_write_bytes",
    "commit_directory",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "read_pointer",
    "remove_tree",
    "write_pointer",
]


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(text: str) -> str | None:
    """``"s3"`` for ``s3://bucket/prefix``; ``None`` for a path (pathlib would read a URL as a relative folder)."""
    match = _SCHEME.match(text)
    return match.group(1) if match else None


POINTER_NAMES = ("LATEST", "BEST")
"""The pointers of a checkpoint folder (a link on a filesystem, an object holding the name in a bucket)."""


OBJECT_SCHEMES = ("s3", "gs", "az", "abfs")
"""The URL schemes of the object stores ckptio has a backend for."""


def _object_storage(url: str) -> Storage:
    """The folder at ``url`` in the object store its scheme names (no pointer resolved)."""
    if url_scheme(url) in ("az", "abfs"):
        from .azure import AzureStorage

        return AzureStorage(url)  # type: ignore[return-value]
    if url_scheme(url) == "gs":
        from .gcs import GCSStorage

        return GCSStorage(url)  # type: ignore[return-value]
    from .s3 import S3Storage

    return S3Storage(url)  # type: ignore[return-value]


def resolve_pointer(url: str) -> str:
    """``s3://bucket/run/LATEST`` (or ``BEST``; ``gs://`` alike) as the step directory its pointer names, as a link
    resolves on a filesystem; any other location unchanged. The pointer's content is checked (a direct child's name)."""
    head, _, last = url.rstrip("/").rpartition("/")
    if last not in POINTER_NAMES or url_scheme(url) not in OBJECT_SCHEMES or head.count("/") < 3:
        return url
    target = _object_storage(head).read_pointer(last)  # type: ignore[attr-defined]
    return f"{head}/{target}" if target is not None else url


def open_storage(location: "str | os.PathLike[str]") -> Storage:
    """The storage behind a checkpoint folder given as a path or a location: the one place that chooses a
    backend (a local POSIX folder, ``s3://bucket/prefix``, ``gs://bucket/prefix`` or ``az://container/prefix``, also
    written ``abfs://``; a URL scheme ckptio has no backend for is refused, never read as a relative folder)."""
    from .objstore._store import ObjectPath

    if isinstance(location, ObjectPath):
        location = str(location)
    text = os.fspath(location)
    scheme = url_scheme(text)
    if scheme in OBJECT_SCHEMES:
        return _object_storage(resolve_pointer(text))
    if scheme:
        raise ConfigError(f"{text!r}: {scheme}:// locations are not supported yet; give a local or mounted folder")
    return LocalStorage(text)


def as_storage(where: "str | os.PathLike[str] | Storage") -> "Storage":
    """``where`` itself when it is a storage already, else :func:`open_storage` of it."""
    if isinstance(where, (str, os.PathLike)):
        return open_storage(where)
    return where
