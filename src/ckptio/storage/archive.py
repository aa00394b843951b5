"""Safe unpacking of tar archives (``.nemo``, ``.qnemo``): nothing outside the target, no surprises.

Refused, before anything is written: absolute paths, ``..`` components, symbolic and hard links that
lead outside the archive's own files, device files and FIFOs, and archives that expand to more than
``max_ratio`` times their size (decompression bombs) or to more than ``max_bytes``. Extraction goes to
a fresh temporary folder beside ``dest`` that is renamed into place only when complete, so a refused or
interrupted unpack leaves nothing behind.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tarfile
import uuid
from pathlib import Path

from ..errors import CheckpointCorruptError, CheckpointError
from .local import fsync_dir, fsync_tree

DEFAULT_MAX_RATIO = 200.0
_MIN_BUDGET = 64 * 1024 * 1024  # small archives may always expand to this much


def _check_members(archive: Path, members: list[tarfile.TarInfo], max_ratio: float, max_bytes: int | None) -> None:
    names = set()
    total = 0
    for m in members:
        name = m.name
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if name.startswith("/") or (len(name) > 1 and name[1] == ":") or "\\" in name:
            raise CheckpointCorruptError(f"{archive}: member {name!r} has an absolute or foreign path")
        if ".." in parts:
            raise CheckpointCorruptError(f"{archive}: member {name!r} climbs out of the archive with '..'")
        if m.isdev() or m.isfifo():
            raise CheckpointCorruptError(f"{archive}: member {name!r} is a device file or FIFO")
        if m.issym() or m.islnk():
            target = m.linkname
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname("/".join(parts)), target)) if m.issym() \
                else posixpath.normpath(target)
            if target.startswith("/") or resolved.startswith("..") or resolved == "..":
                raise CheckpointCorruptError(f"{archive}: link {name!r} -> {target!r} points outside the archive")
        elif not (m.isfile() or m.isdir()):
            raise CheckpointCorruptError(f"{archive}: member {name!r} has an unsupported type")
        names.add("/".join(parts))
        total += max(0, m.size)
    budget = max(_MIN_BUDGET, archive.stat().st_size * max_ratio)
    if max_bytes is not None:
        budget = min(budget, max_bytes)
    if total > budget:
        raise CheckpointCorruptError(
            f"{archive}: expands to {total} bytes, more than the {int(budget)} allowed "
            f"(max_ratio={max_ratio} of its {archive.stat().st_size} bytes); refusing a possible decompression bomb"
        )


def safe_extract(archive: str | Path, dest: str | Path, *, max_ratio: float = DEFAULT_MAX_RATIO,
                 max_bytes: int | None = None) -> Path:
    """Unpack ``archive`` (tar, optionally gzip) into the new folder ``dest``; return ``dest``."""
    archive, dest = Path(archive), Path(dest)
    if dest.exists():
        raise CheckpointError(f"{dest} already exists; unpack into a new folder")
    try:
        tar = tarfile.open(archive, mode="r:*")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CheckpointCorruptError(f"{archive}: not a readable tar archive ({exc})") from exc
    tmp = dest.parent / f".{dest.name}.unpack-{uuid.uuid4().hex[:8]}"
    try:
        with tar:
            try:
                members = tar.getmembers()
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise CheckpointCorruptError(f"{archive}: damaged tar archive ({exc})") from exc
            _check_members(archive, members, max_ratio, max_bytes)
            tmp.mkdir(parents=True)
            links = []
            for m in members:
                rel = "/".join(p for p in m.name.split("/") if p not in ("", "."))
                if not rel:
                    continue
                target = tmp / rel
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                elif m.isfile():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    src = tar.extractfile(m)
                    if src is None:
                        raise CheckpointCorruptError(f"{archive}: cannot read member {m.name!r}")
                    with src, open(target, "xb") as out:
                        shutil.copyfileobj(src, out, 8 * 1024 * 1024)
                else:
                    links.append((m, target))
            for m, target in links:  # after the files, so hard links find their targets
                target.parent.mkdir(parents=True, exist_ok=True)
                if m.issym():
                    os.symlink(m.linkname, target)
                else:
                    os.link(tmp / posixpath.normpath(m.linkname), target)
        fsync_tree(tmp)
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
