"""Safe unpacking of tar archives (``.nemo``, ``.qnemo``): nothing outside the target, no links, no surprises.

Every archive ckptio reads goes through :func:`safe_extract`:

* names are checked by Python's own extraction filter (``tarfile.data_filter``: no absolute paths, no
  ``..``, no device files or FIFOs, no setuid bits), and regular files and folders are extracted with it;
* links are never created on disk. A symbolic or hard link member is resolved inside the archive's own
  namespace (following chains of links, with a depth limit) to a regular file member and written as a
  plain copy of it. A link that leads outside the archive, to a folder, to a missing member or round in a
  circle is refused, and so is a member whose path passes through a link member. With no link on disk,
  no later member can be written through one, whatever order the archive lists them in;
* ckptio's own limits sit on top: at most ``max_members`` members, at most ``max_bytes`` in all, and at
  most ``max_ratio`` times the archive's size (decompression bombs); a file name listed twice is refused.

Extraction goes to a fresh temporary folder beside ``dest`` that is renamed into place only when
complete, so a refused or interrupted unpack leaves nothing behind.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tarfile
import uuid
from pathlib import Path
from typing import Callable, Iterable

from ..errors import CheckpointCorruptError, CheckpointError
from .local import fsync_dir, fsync_tree

DEFAULT_MAX_RATIO = 200.0
DEFAULT_MAX_MEMBERS = 100_000
_MIN_BUDGET = 64 * 1024 * 1024  # small archives may always expand to this much
_MAX_LINK_DEPTH = 32


def _norm(name: str) -> str:
    return "/".join(p for p in name.split("/") if p not in ("", "."))


def _plan(archive: Path, members: list[tarfile.TarInfo], dest: Path, max_ratio: float, max_bytes: int | None,
          max_members: int) -> tuple[list[tarfile.TarInfo], list[tuple[str, str]]]:
    """(members to extract with the data filter, [(link path, file it copies)]), or an error naming the member."""
    if len(members) > max_members:
        raise CheckpointCorruptError(f"{archive}: holds {len(members)} members, more than the {max_members} allowed")
    kinds: dict[str, str] = {}
    extract: list[tarfile.TarInfo] = []
    links: dict[str, tarfile.TarInfo] = {}
    total = 0
    for m in members:
        if m.name.startswith("/") or "\\" in m.name or (len(m.name) > 1 and m.name[1] == ":"):
            # the data filter would strip the slash and extract inside; an archive of ours never has one
            raise CheckpointCorruptError(f"{archive}: member {m.name!r} has an absolute or foreign path")
        try:
            tarfile.data_filter(m, str(dest))  # Python's checks of names, types and modes
        except tarfile.FilterError as exc:
            raise CheckpointCorruptError(f"{archive}: member {m.name!r} is refused ({type(exc).__name__}: {exc})") from exc
        name = _norm(m.name)
        if not name:
            continue
        if m.isdir():
            if kinds.get(name, "dir") != "dir":
                raise CheckpointCorruptError(f"{archive}: {name!r} is listed both as a folder and as a file")
            kinds[name] = "dir"
        elif m.isfile() or m.issym() or m.islnk():
            if name in kinds:
                raise CheckpointCorruptError(f"{archive}: member {name!r} is listed more than once")
            kinds[name] = "file" if m.isfile() else "link"
        else:
            raise CheckpointCorruptError(f"{archive}: member {m.name!r} has an unsupported type")
        if m.issym() or m.islnk():
            links[name] = m
        else:
            extract.append(m)
        total += max(0, m.size)
    for name in kinds:  # nothing may be written through a link member, nor below a file
        parts = name.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if kinds.get(parent, "dir") != "dir":
                raise CheckpointCorruptError(f"{archive}: member {name!r} lies below {parent!r}, which is a "
                                             f"{'link' if kinds[parent] == 'link' else 'file'}")
    copies = []
    for name, m in links.items():
        copies.append((name, _resolve(archive, name, links, kinds)))
    budget = max(_MIN_BUDGET, archive.stat().st_size * max_ratio)
    if max_bytes is not None:
        budget = min(budget, max_bytes)
    sizes = {_norm(x.name): max(0, x.size) for x in extract}
    copied = sum(sizes[target] for _, target in copies)
    if total + copied > budget:
        raise CheckpointCorruptError(
            f"{archive}: expands to {total + copied} bytes, more than the {int(budget)} allowed "
            f"(max_ratio={max_ratio} of its {archive.stat().st_size} bytes); refusing a possible decompression bomb"
        )
    return extract, copies


def _resolve(archive: Path, name: str, links: dict[str, tarfile.TarInfo], kinds: dict[str, str]) -> str:
    """The regular file member that the link ``name`` finally leads to, inside the archive."""
    seen = [name]
    current = name
    for _ in range(_MAX_LINK_DEPTH):
        m = links[current]
        target = m.linkname
        joined = posixpath.join(posixpath.dirname(current), target) if m.issym() else target
        resolved = posixpath.normpath(joined) if joined else ""
        if target.startswith("/") or resolved in ("", ".") or resolved == ".." or resolved.startswith("../"):
            raise CheckpointCorruptError(f"{archive}: link {name!r} leads outside the archive (via {current!r} -> "
                                         f"{target!r})")
        kind = kinds.get(resolved)
        if kind == "file":
            return resolved
        if kind == "dir":
            raise CheckpointCorruptError(f"{archive}: link {name!r} leads to the folder {resolved!r}; links to "
                                         "folders are refused")
        if kind is None:
            raise CheckpointCorruptError(f"{archive}: link {name!r} leads to {resolved!r}, which the archive does "
                                         "not hold")
        if resolved in seen:
            raise CheckpointCorruptError(f"{archive}: link {name!r} is part of a cycle ({' -> '.join(seen)})")
        seen.append(resolved)
        current = resolved
    raise CheckpointCorruptError(f"{archive}: link {name!r} is a chain of more than {_MAX_LINK_DEPTH} links")


def safe_extract(archive: str | Path, dest: str | Path, *, max_ratio: float = DEFAULT_MAX_RATIO,
                 max_bytes: int | None = None, max_members: int = DEFAULT_MAX_MEMBERS,
                 progress: Callable[[int], object] | None = None) -> Path:
    """Unpack ``archive`` (tar, optionally gzip) into the new folder ``dest``; return ``dest``.

    ``progress`` is called with the size of each member as it is unpacked."""
    archive, dest = Path(archive), Path(dest)
    if not hasattr(tarfile, "data_filter"):  # pragma: no cover - guarded by requires-python as well
        raise CheckpointError("unpacking archives safely needs Python 3.11.4 or newer (tarfile extraction filters)")
    if dest.exists():
        raise CheckpointError(f"{dest} already exists; unpack into a new folder")
    if archive.is_symlink() or not archive.is_file():
        raise CheckpointCorruptError(f"{archive}: not a regular file")
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
            extract, copies = _plan(archive, members, tmp, max_ratio, max_bytes, max_members)
            tmp.mkdir(parents=True)
            try:
                chosen: Iterable[tarfile.TarInfo] = (
                    extract if progress is None else (m for m in extract if progress(max(0, m.size)) or True))
                tar.extractall(tmp, members=chosen, filter="data")
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise CheckpointCorruptError(f"{archive}: cannot be unpacked ({type(exc).__name__}: {exc})") from exc
        for name, target in copies:  # links become plain copies of the file they lead to
            out = tmp / name
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp / target, out, follow_symlinks=False)
        fsync_tree(tmp)
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
