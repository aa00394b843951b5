"""Durable POSIX primitives under :mod:`ckptio.storage.local`: fsync, atomic rename and exchange, hidden deletion, pointers.

The commit protocol ckptio relies on: files are written inside a temporary directory, every file and
directory is fsynced, then the directory is renamed into place and its parent fsynced. ``rename`` is
atomic on POSIX filesystems, so a reader sees either no directory or a complete one.

These functions are called by one process at a time for a given path (the manager calls them on
rank 0 only, except :func:`fsync_file`, which each rank calls on the files it wrote).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable

from ..errors import CheckpointError

POINTER_TEXT_SUFFIX = ".txt"


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's data to disk (``fsync`` through a read-only descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Writeback:
    """Starts the kernel writing a file's pages to its device while the file is still being written.

    A write lands in the page cache; left alone, the device sees nothing until the closing fsync, which then
    waits for the whole file. Asking for write-out (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which
    does not wait) of every ``step`` bytes as they are written keeps the device busy while the next bytes are
    still being copied, so the fsync that makes the file durable finds most of it written already: on this
    machine a 1.2 GB file became durable in ~0.75x the time of a write followed by one fsync. Where the call
    does not exist (other systems, or a filesystem that refuses it) this does nothing, and durability still
    rests on the fsync alone.
    """

    step = 32 << 20

    def __init__(self, fd: int, start: int = 0) -> None:
        self.fd, self.kicked = fd, start

    def advance(self, end: int) -> None:
        """The bytes before offset ``end`` are written: start writing out the part not asked for yet, in steps."""
        if end - self.kicked >= self.step and _sync_file_range is not None:
            if _sync_file_range(self.fd, self.kicked, end - self.kicked, 2) == 0:  # 2: SYNC_FILE_RANGE_WRITE
                self.kicked = end
            else:  # refused here (e.g. not supported by this filesystem): stop asking
                self.kicked = 1 << 62


def _libc_sync_file_range():  # type: ignore[no-untyped-def]
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


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
    for dirpath, _dirnames, filenames in os.walk(os.fspath(root), topdown=False):
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


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unavailable."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # the filesystem cannot exchange: fall back
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def commit_directory(tmp_dir: Path, final_dir: Path) -> None:
    """Move a finished, fsynced ``tmp_dir`` to ``final_dir`` atomically.

    If ``final_dir`` already exists (the same step saved again, or a checkpoint rewritten), the two are
    exchanged in one atomic step where the filesystem can (``renameat2``), and the old one is removed;
    elsewhere the old one is first renamed to the visible name ``<name>.replaced-<id>``, so that a crash
    between the two renames still leaves a committed copy that discovery finds (never only a hidden one
    that the next sweep would delete).
    """
    parent = final_dir.parent
    if not final_dir.exists():
        os.rename(tmp_dir, final_dir)
        fsync_dir(parent)
        return
    from .. import _faults

    if _exchange(tmp_dir, final_dir):
        fsync_dir(parent)
        _faults.point("commit.after_exchange")
        remove_tree(tmp_dir)  # now holds the old directory
        return
    old = parent / f"{final_dir.name}.replaced-{uuid.uuid4().hex[:8]}"
    os.rename(final_dir, old)
    fsync_dir(parent)
    _faults.point("commit.after_moving_old")
    os.rename(tmp_dir, final_dir)
    fsync_dir(parent)
    remove_tree(old)


def copy_on_write(src: Path, dest: Path, *, skip: Callable[[str], bool]) -> None:
    """A new folder ``dest`` holding ``src``'s files as hard links (copies where links are not possible).

    ``skip(rel)`` leaves a file (or a whole folder) out. The files are shared, never written: anything that
    changes in ``dest`` must be written as a new file after removing its link.
    """
    dest.mkdir()
    for dirpath, dirnames, filenames in os.walk(src):
        rel_dir = os.path.relpath(dirpath, src)
        rel_dir = "" if rel_dir == "." else rel_dir
        dirnames[:] = [d for d in dirnames if not skip(os.path.join(rel_dir, d)) and
                       not os.path.islink(os.path.join(dirpath, d))]
        for d in dirnames:
            (dest / rel_dir / d).mkdir()
        for name in filenames:
            rel = os.path.join(rel_dir, name)
            source = os.path.join(dirpath, name)
            if skip(rel) or os.path.islink(source):
                continue
            try:
                os.link(source, dest / rel)
            except OSError:
                shutil.copyfile(source, dest / rel)


def remove_tree(path: Path) -> None:
    """Delete a directory so that no crash leaves a half-deleted directory under its real name (a file or a link
    in its place, such as a Lightning ``.ckpt`` file a ckptio folder replaced, is simply unlinked)."""
    if path.is_symlink() or path.exists() and not path.is_dir():
        path.unlink()
        return
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
    if link.is_dir() and not link.is_symlink():
        _move_aside(link)
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


def _move_aside(link: Path) -> Path:
    """A pointer that is a folder (the checkpoint directory was copied by a tool that follows links:
    ``shutil.copytree``'s default, ``aws s3 sync``): moved aside under a hidden name that nothing sweeps, so the
    link can take its place and nothing the user has is lost; said once, with what to do."""
    import logging

    aside = link.parent / f".{link.name}.copied-{uuid.uuid4().hex[:8]}"
    os.rename(link, aside)
    fsync_dir(link.parent)
    logging.getLogger("ckptio").warning(
        "%s was a folder, not a link to a checkpoint (the directory was copied by a tool that follows links, such as "
        "shutil.copytree or aws s3 sync); it is moved aside to %s and %s is a link again. It holds a copy of a "
        "checkpoint: delete it once you have checked that you need nothing from it.", link, aside.name, link.name)
    return aside


MAX_POINTER_BYTES = 4096


def read_pointer(checkpoint_dir: Path, name: str) -> str | None:
    """The step directory name a pointer refers to, or ``None`` if there is no pointer.

    Raises :class:`~ckptio.CheckpointCorruptError` naming the pointer when it exists but does not name a
    direct child of ``checkpoint_dir`` (a path, ``..``, an absolute target, a hidden name), or when its
    text file is larger than a pointer can be. The target itself is not checked here: callers resolve
    it with :func:`ckptio.engine.layout.pointer_target`, which also refuses a target that is a link.
    """

    link = Path(checkpoint_dir) / name
    if link.is_symlink():
        target = os.readlink(link)
        where = link
    else:
        text_file = Path(checkpoint_dir) / (name + POINTER_TEXT_SUFFIX)
        if not text_file.exists() and not text_file.is_symlink():
            return None
        from .confined import Folder

        where = text_file
        target = Folder(checkpoint_dir).read_text(text_file.name, max_size=MAX_POINTER_BYTES).strip()
    return check_pointer_target(target, where, checkpoint_dir)


def check_pointer_target(target: str, where: object, checkpoint_dir: object) -> str:
    """``target`` if it names a direct child of the checkpoint folder (every storage's pointers are checked
    here); otherwise a :class:`~ckptio.CheckpointCorruptError` naming the pointer ``where``."""
    from ..errors import CheckpointCorruptError

    if not target or "/" in target or "\\" in target or target.startswith(".") or len(target) > 255 \
            or any(ord(c) < 32 for c in target):
        raise CheckpointCorruptError(
            f"{where}: the pointer names {target!r:.200}, not a checkpoint directory directly inside {checkpoint_dir}"
        )
    return target


_LEFTOVER = re.compile(r"^(\..+\.tmp-[0-9a-f]{8}|\.trash-.+-[0-9a-f]{8}|.+\.replaced-[0-9a-f]{8})$")


def sweep_leftovers(folder: str | Path) -> list[Path]:
    """Remove what a killed save or removal left in ``folder``: the hidden folder a save was writing
    (``.NAME.tmp-*``), a hidden deletion (``.trash-*``) and, where directories cannot be exchanged atomically,
    the old copy of a replaced checkpoint (``NAME.replaced-*``, only once ``NAME`` is in place). Links are left
    alone. Returns what was removed."""
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for p in sorted(folder.iterdir()):
        if not _LEFTOVER.match(p.name) or p.is_symlink() or not p.is_dir():
            continue
        if ".replaced-" in p.name and not p.name.startswith(".") and \
                not (folder / p.name.rsplit(".replaced-", 1)[0] / "manifest.json").is_file():
            continue  # its replacement is not in place: this is still the only copy
        remove_tree(p)
        removed.append(p)
    return removed
