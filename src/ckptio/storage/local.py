"""Local (POSIX) storage: the implementation of :mod:`ckptio.storage.base` ckptio ships today.

A step directory is written under ``.tmp-<name>-<id>`` beside its final name; every file is written with
a running checksum and fsynced as it is closed; :meth:`LocalFolderWriter.commit` writes the manifest,
fsyncs the tree and renames the folder into place (or exchanges it atomically with an existing one). A
reader therefore sees no directory or a complete one.
"""

from __future__ import annotations

import contextlib

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from .base import ClosedOnSuccess
from .posix import (Writeback, atomic_write_bytes, commit_directory, fsync_dir, fsync_tree, read_pointer, remove_tree,
                    write_pointer)

if TYPE_CHECKING:
    from .confined import Folder
    from .lock import DirectoryLock

__all__ = ["LocalStorage", "LocalFolderWriter", "LocalFileWriter", "LocalWriteStream", "TMP_PREFIX", "TRASH_PREFIX"]

class LocalWriteStream(ClosedOnSuccess):
    """A new local file written front to back with a running CRC-32C; :meth:`close` fsyncs it.

    Short writes are retried until done, so a full disk or a file-size limit surfaces as its own
    ``OSError`` (ENOSPC, EFBIG), which is also kept in :attr:`error` for callers that swallow it.
    """

    def __init__(self, path: Path, *, durable: bool = True) -> None:
        from .checksum import ChecksummingStream

        self.path = path
        self._raw = open(path, "xb")  # noqa: SIM115 - closed by close()
        self._out = ChecksummingStream(self._raw)
        self._durable = durable
        self._digest: str | None = None
        self._writeback = Writeback(self._raw.fileno()) if durable else None

    @property
    def error(self) -> OSError | None:
        return self._out.error

    @property
    def digest(self) -> str:
        return self._out.checksum.digest

    @property
    def size(self) -> int:
        return self._out.checksum.size

    def write(self, data: object) -> int:
        n = self._out.write(data)
        if self._writeback is not None:
            self._writeback.advance(self._out.checksum.size)
        return n

    def writeback_from(self, start: int) -> Writeback | None:
        """What writes a region of this file from ``start`` uses to have its bytes written out as they come
        (:mod:`ckptio.storage.regions`); ``None`` for a file that is not made durable (e.g. an upload's spool)."""
        return Writeback(self._raw.fileno(), start) if self._durable else None

    def adopt_checksum(self, value: int, size: int) -> None:
        """Take the CRC-32C of content written past this stream (in regions, see :mod:`ckptio.storage.regions`)."""
        self._out.checksum.value, self._out.checksum.size = value, size

    def fileno(self) -> int:
        return self._raw.fileno()

    def tell(self) -> int:
        return self._out.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._out.seek(offset, whence)  # only to where it already is: the stream is write-once

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> str:
        if self._digest is None:
            try:
                self._raw.flush()
                if self._durable:
                    os.fsync(self._raw.fileno())
            finally:
                self._raw.close()
            self._digest = self.digest
        return self._digest

    def discard(self) -> None:
        """Close without making durable (the file is about to be removed with its folder)."""
        if self._digest is None:
            self._raw.close()
            self._digest = self.digest


class LocalFolderWriter:
    """A new folder written under a hidden temporary name beside ``final`` and renamed into place at commit.

    See :class:`ckptio.storage.base.FolderWriter` for the contract. ``commit`` fsyncs every file and
    folder, then renames (or atomically exchanges with an existing folder of that name, see
    :func:`commit_directory`); a crash before it leaves only the hidden temporary folder, which the
    next sweep removes.
    """

    def __init__(self, final: Path, tmp: Path) -> None:
        self.final = Path(final)
        self.tmp = Path(tmp)
        self.name = self.final.name
        self.token = self.tmp.name

    @classmethod
    def in_place(cls, folder: str | Path) -> "LocalFolderWriter":
        """A writer into the existing (or new) folder itself, with nothing to rename at commit: for scratch
        folders and callers that manage the folder's visibility themselves."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        return cls(folder, folder)

    @classmethod
    def create(cls, final: str | Path) -> "LocalFolderWriter":
        """A writer for the new folder ``final`` (its parent must exist)."""
        final = Path(final)
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return cls(final, tmp)

    def _path(self, rel: str) -> Path:
        from .confined import check_relative

        check_relative(rel, self.tmp)
        return self.tmp / rel

    def open(self, rel: str) -> LocalWriteStream:
        path = self._path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        return LocalWriteStream(path)

    def write_bytes(self, rel: str, data: bytes) -> str:
        with self.open(rel) as out:
            out.write(data)
        return out.digest

    def link(self, rel: str, source: str, size: int) -> bool:
        """Make ``rel`` a hard link to ``source``, a committed file of the checkpoint folder (``step/path``) of
        ``size`` bytes, instead of writing it; ``False`` (write it) when ``source`` is not such a regular file,
        through no link, or the filesystem refuses (another device, no hard links)."""
        from .. import _faults
        from .confined import Folder

        target = self._path(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        _faults.point("save.before_link")
        return _hard_link(Folder(self.final.parent), source, target, size)

    def local_path(self, rel: str = "") -> Path:
        path = self._path(rel) if rel else self.tmp
        path.mkdir(parents=True, exist_ok=True)
        return path

    def rename(self, rel: str, new_rel: str) -> None:
        os.rename(self._path(rel), self._path(new_rel))

    def reader(self, rel: str = "") -> "Folder":
        from .confined import Folder

        return Folder(self.local_path(rel))

    def exists(self, rel: str) -> bool:
        return self._path(rel).exists()

    def checksum_of(self, rel: str) -> str:
        from .checksum import file_checksum

        return file_checksum(self._path(rel))

    def files(self) -> dict[str, int]:
        return {p.relative_to(self.tmp).as_posix(): p.stat().st_size
                for p in sorted(self.tmp.rglob("*")) if p.is_file() and not p.is_symlink()}

    def commit(self, manifest: tuple[str, bytes] | None = None) -> Path:
        from .. import _faults

        _faults.point("commit.before_manifest")
        if manifest is not None:
            self.write_bytes(*manifest)
        fsync_tree(self.tmp)
        if self.tmp != self.final:
            _faults.point("commit.before_rename")
            commit_directory(self.tmp, self.final)
        return self.final

    def abort(self) -> None:
        if self.tmp.exists() and self.tmp != self.final:
            remove_tree(self.tmp)


def _hard_link(folder: "Folder", rel: str, target: Path, size: int) -> bool:
    """Give the regular file ``rel`` of ``folder`` (``size`` bytes) the new name ``target``, reached through no link
    (the gate's walk; the check and the link through one descriptor); ``False`` when it is not such a file or the
    filesystem refuses (another device, no hard links)."""
    import stat

    from ..errors import CheckpointCorruptError, CheckpointNotFoundError
    from .confined import check_relative

    parts = check_relative(rel, folder.path)
    try:
        fd, name = folder._walk(parts)
    except (CheckpointCorruptError, CheckpointNotFoundError):
        return False
    try:
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return False
        os.link(name, target, src_dir_fd=fd, follow_symlinks=False)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class LocalFileWriter:
    """A new single file written under a hidden temporary name beside ``final``, renamed into place at commit."""

    def __init__(self, final: str | Path) -> None:
        self.final = Path(final)
        self.tmp = self.final.parent / f".{self.final.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.stream = LocalWriteStream(self.tmp)

    def commit(self) -> Path:
        self.stream.close()
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return self.final

    def abort(self) -> None:
        self.stream.discard()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "LocalFileWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


class LocalStorage:
    """A checkpoint folder on a local (POSIX) filesystem. See :class:`ckptio.storage.base.Storage`."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def folder(self, rel: str = "", *, verifier: object = None) -> "Folder":
        from .confined import Folder

        top = Folder(self.root, verifier=verifier)  # type: ignore[arg-type]
        return top.sub(rel) if rel else top

    def session(self) -> "contextlib.AbstractContextManager[None]":
        return contextlib.nullcontext()  # the kernel keeps what a local folder lists and reads

    def share_step(self, name: str) -> None:
        """Nothing to share: each rank reads a local folder through the page cache."""

    def begin_step(self, name: str) -> LocalFolderWriter:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return LocalFolderWriter(self.root / name, tmp)

    def attach_step(self, token: str, name: str) -> LocalFolderWriter:
        return LocalFolderWriter(self.root / name, self.root / token)

    def remove_step(self, name: str) -> None:
        remove_tree(self.root / name)

    def remove_part(self, name: str, rel: str) -> None:
        """Remove the folder or file ``rel`` of the step ``name`` (hidden first), and what an interrupted removal
        there left; ``rel`` must stay inside the step, through no link."""
        from ..errors import CheckpointError
        from .confined import check_relative

        step = self.root / name
        target = step.joinpath(*check_relative(rel, step))
        for parent in [target, *target.parents]:
            if parent == step:
                break
            if parent.is_symlink():
                raise CheckpointError(f"{parent}: a link inside a step directory is never followed to remove it")
        remove_tree(target)
        for trash in step.glob(".trash-*") if step.is_dir() and not step.is_symlink() else ():
            remove_tree(trash)

    def sweep(self, older_than_s: float = 0.0) -> list[Path]:
        """Remove leftovers of interrupted saves and deletions (``.tmp-*``, ``.trash-*``)."""
        import time

        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        now = time.time()
        for p in self.root.iterdir():
            if not (p.name.startswith(TMP_PREFIX) or p.name.startswith(TRASH_PREFIX)) or p.is_symlink():
                continue
            try:
                if now - p.stat().st_mtime < older_than_s:
                    continue
                from .. import _faults

                _faults.point("sweep.before_remove")
                if p.is_dir():
                    remove_tree(p)
                else:
                    p.unlink()
                removed.append(p)
            except FileNotFoundError:
                continue
        return removed

    def write_pointer(self, name: str, target: str) -> None:
        write_pointer(self.root, name, target)

    def write_small(self, name: str, data: bytes) -> None:
        """Replace the small file ``name`` at the root whole (written aside, fsynced, renamed over it)."""
        atomic_write_bytes(self.root / name, data)

    def read_pointer(self, name: str) -> str | None:
        return read_pointer(self.root, name)

    def lock(self) -> "DirectoryLock":
        from .lock import DirectoryLock

        return DirectoryLock(self.root)

    def check_writable(self) -> None:
        from ..errors import ConfigError

        existing = self.root  # the folder, or the nearest folder above it that exists (where it will be made)
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if os.access(existing, os.W_OK | os.X_OK):
            return
        try:
            read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        why = "it is on a read-only filesystem" if read_only else "this user has no permission to write there"
        where = "" if existing == self.root else f" (it would be made inside {existing}, which is not)"
        raise ConfigError(f"checkpoint_dir={str(self.root)!r} is not writable{where}: {why}. A manager made to train "
                          "(with an optimizer or a step scheduler) saves there: give a writable folder (to load from "
                          "this one, make the manager with the model only, or set restore_from to it)")
