"""Durable local-filesystem primitives.

The commit protocol ckptio relies on: files are written inside a temporary directory, every file and
directory is fsynced, then the directory is renamed into place and its parent fsynced. ``rename`` is
atomic on POSIX filesystems, so a reader sees either no directory or a complete one.

These functions are called by one process at a time for a given path (the manager calls them on
rank 0 only, except :func:`fsync_file`, which each rank calls on the files it wrote).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from ..errors import CheckpointError

POINTER_TEXT_SUFFIX = ".txt"


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of a directory (creations, renames, deletions) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # some platforms cannot open directories; nothing more can be done there
    try:
        os.fsync(fd)
    except OSError:
        pass  # filesystems without directory fsync (some network mounts) make entries durable on their own
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory below ``root``, deepest first, then ``root`` itself."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_file(path)
        fsync_dir(dirpath)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old content or the new, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def commit_directory(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a finished, fsynced ``tmp_dir`` to ``final_dir`` atomically.

    If ``final_dir`` already exists (the same step saved twice), it is first renamed to a hidden
    trash name, so a crash leaves either the old or the new directory under the final name, or
    neither (never a mix); the trash is removed afterwards.
    """
    parent = final_dir.parent
    trash = None
    if final_dir.exists():
        trash = parent / f".trash-{final_dir.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final_dir, trash)
    os.rename(tmp_dir, final_dir)
    fsync_dir(parent)
    if trash is not None:
        remove_tree(trash)


def remove_tree(path: Path) -> None:
    """Delete a directory so that no crash leaves a half-deleted directory under its real name."""
    if not path.exists():
        return
    if not path.name.startswith(".trash-"):
        trash = path.parent / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        fsync_dir(path.parent)
        path = trash
        from .. import _faults

        _faults.point("delete.after_hide")
    shutil.rmtree(path)


def write_pointer(checkpoint_dir: Path, name: str, target: str) -> None:
    """Point ``checkpoint_dir/name`` at the step directory ``target`` (a relative symlink).

    The link is created under a temporary name and renamed over the old one, so readers never see a
    missing pointer. Where symlinks are not available, ``name.txt`` holds the target instead.
    """
    link = checkpoint_dir / name
    tmp = checkpoint_dir / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        os.symlink(target, tmp, target_is_directory=True)
    except (OSError, NotImplementedError):
        atomic_write_bytes(checkpoint_dir / (name + POINTER_TEXT_SUFFIX), (target + "\n").encode())
        return
    try:
        os.replace(tmp, link)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot update pointer {link}: {exc}") from exc
    fsync_dir(checkpoint_dir)


def read_pointer(checkpoint_dir: Path, name: str) -> str | None:
    """The step directory name a pointer refers to, or ``None`` if there is no pointer.

    Only a bare directory name inside ``checkpoint_dir`` is accepted; a pointer that tries to lead
    elsewhere (``..``, an absolute path) is ignored.
    """
    link = checkpoint_dir / name
    target: str | None = None
    if link.is_symlink():
        target = os.readlink(link)
    else:
        text_file = checkpoint_dir / (name + POINTER_TEXT_SUFFIX)
        if text_file.is_file():
            target = text_file.read_text(encoding="utf-8", errors="replace").strip()
    if not target or "/" in target or "\\" in target or target in (".", ".."):
        return None
    return target
