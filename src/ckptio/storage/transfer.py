"""Whole folders between object storage and a local disk, for the commands that work on local files.

``convert`` reads and writes formats through local paths. With an ``s3://`` (or ``gs://``) source, the folder is
first copied down (:func:`copy_down`) into a private temporary folder — a step directory's copy is checked
against its manifest's checksums before it is used, so a damaged object is refused, never converted;
with an ``s3://`` (``gs://``) destination the result is written locally and copied up (:func:`copy_up`), its
``manifest.json`` (if any) last, with create-only writes into a prefix the caller found empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CheckpointError

__all__ = ["copy_down", "copy_file_down", "copy_up", "exists"]

CHUNK = 8 << 20


def copy_down(url: str, dest: Path) -> Path:
    """Copy the folder at ``url`` into the new local folder ``dest``; a step directory's copy is then checked
    against its manifest (every listed file present, of its size and checksum) before it is used."""
    from ..errors import CheckpointCorruptError
    from ..engine.manifest import MANIFEST_NAME, check_files, read_manifest
    from .confined import as_folder

    folder = as_folder(url)
    files = [rel for rel, e in folder.walk_files() if e.kind == "file"]
    if not files:
        raise CheckpointError(f"{url}: no such folder, or it is empty")
    dest.mkdir(parents=True)
    for rel in files:
        copy_file_down(folder, rel, dest / rel)
    if MANIFEST_NAME in files:
        problems = check_files(dest, read_manifest(dest), checksums=True)
        if problems:
            raise CheckpointCorruptError(f"{url}: {len(problems)} file(s) do not match the manifest: {problems[0]}")
    return dest


def copy_file_down(folder: Any, rel: str, out: Path) -> Path:
    """Copy the file ``rel`` of ``folder`` (local or in object storage, read confined) to the local path ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with folder.open(rel) as handle, open(out, "wb") as fh:
        for offset in range(0, handle.size, CHUNK):
            fh.write(handle.read(offset, min(CHUNK, handle.size - offset)))
    return out


def copy_up(src: Path, url: str) -> str:
    """Upload the local file or folder ``src`` to the new location ``url`` (check it with :func:`exists` first:
    every object is written create-only, so one already there fails the upload rather than being replaced)."""
    from ..engine.manifest import MANIFEST_NAME
    from . import open_storage

    storage = open_storage(url)
    if not storage.prefix:  # type: ignore[attr-defined]
        raise CheckpointError(f"{url}: name a new folder inside the bucket (s3://bucket/name, gs://bucket/name)")
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.name == MANIFEST_NAME)  # the commit point goes last
    for path in files:
        rel = path.name if src.is_file() else path.relative_to(src).as_posix()
        storage.store.upload_file(path, f"{storage.prefix}/{rel}", if_absent=True)  # type: ignore[attr-defined]
    return url


def exists(url: str) -> bool:
    """Whether anything (an object, or objects below it) is at the ``s3://`` (``gs://``) location ``url``."""
    from . import open_storage

    parent, _, name = url.rstrip("/").rpartition("/")
    if "://" not in parent or not name:
        return False
    return open_storage(parent).folder().kind(name) is not None
