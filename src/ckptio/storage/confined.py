"""Reading a checkpoint without ever leaving it: the one gate every reader of ckptio opens files through.

A :class:`Folder` is a directory whose files are read by paths relative to it. Whatever a path comes
from (a manifest, DCP's ``.metadata``, a pointer, a safetensors index, a ``.nemo`` config), it is
resolved the same way:

* it must be a plain relative path: no absolute path, no ``..`` or ``.`` component, no backslash, no NUL;
* every directory on the way is opened with ``O_NOFOLLOW`` relative to the one before (``openat``), so a
  symbolic link anywhere below the folder is refused rather than followed, and a link swapped in after
  a check cannot redirect the read;
* the file itself is opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be a regular file (a FIFO cannot
  hang the reader, a device cannot feed it endless bytes);
* its size is checked against what the caller expects, and every read is bounded by that size.

The folder itself may be reached through a link (a user's ``checkpoints -> /scratch/run1`` is fine);
only what lies below it is confined. ``links=True`` relaxes the rule for folders the user names
directly and that legitimately hold links to regular files (a Hugging Face cache snapshot, whose
files link into ``blobs/``); even then every target must be a regular file.

With a :class:`~ckptio.storage.verify.Verifier` attached, every byte read through a handle also feeds
a running CRC-32C (see :mod:`ckptio.storage.verify`).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Iterator

from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from . import reading
from .reading import HandleStream

__all__ = ["Folder", "ReadHandle", "check_relative", "UnsafePathError"]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_PIECE = 4 * 1024 * 1024  # a verified read is hashed in pieces of this size, overlapping the next read
_SMALL = 1 << 20  # a verified read this small is hashed on the reader's thread when the hashing thread is idle
ADVICE_SLACK = 64 << 10
"""Advised ranges (:meth:`ReadHandle.advise`) closer than this are one range."""


class UnsafePathError(CheckpointCorruptError):
    """A path inside a checkpoint leads outside it, through a link, or to something that is not a file."""


NAME_MAX = 255
"""The longest name of one file or folder (bytes) on the file systems and object stores ckptio writes to."""


def check_relative(rel: object, where: object) -> tuple[str, ...]:
    """The components of ``rel`` if it is a plain relative path; otherwise :class:`UnsafePathError`."""
    if not isinstance(rel, str) or not rel:
        raise UnsafePathError(f"{where}: file path {rel!r} is not a non-empty string")
    if "\0" in rel or "\\" in rel or rel.startswith("/") or (len(rel) > 1 and rel[1] == ":"):
        raise UnsafePathError(f"{where}: file path {rel!r} is absolute or not a plain relative path")
    parts = tuple(rel.split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"{where}: file path {rel!r} must not contain '..', '.' or empty components")
    if any(len(p.encode("utf-8", "surrogatepass")) > NAME_MAX for p in parts):
        raise UnsafePathError(f"{where}: file path {rel[:80]!r}... has a component longer than {NAME_MAX} bytes")
    return parts


def as_folder(where: Any) -> Any:
    """The reader for ``where``: itself when it is a folder already (local or in object storage), the
    folder of its storage when it is an object-store location, else a local :class:`Folder`."""
    if isinstance(where, (str, os.PathLike)):
        if isinstance(where, PurePath) and not isinstance(where, Path) or \
                isinstance(where, str) and "://" in where:
            from . import open_storage, resolve_pointer

            location = resolve_pointer(str(where).rstrip("/"))
            parent, _, name = location.rpartition("/")
            return open_storage(parent).folder(name)
        return Folder(where)
    return where


@dataclass(frozen=True)
class Entry:
    """One name in a folder listing (links are reported, never followed)."""

    name: str
    kind: str
    """``file``, ``dir``, ``link`` or ``other`` (FIFO, device, socket)."""
    size: int


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "other"


class FolderReads:
    """What every folder reader (local :class:`Folder`, a folder in object storage) derives from its
    ``kind``, ``listdir`` and ``open``: the same checks, written once."""

    path: Any

    def kind(self, rel: str) -> str | None:
        raise NotImplementedError

    def listdir(self, rel: str = "") -> "list[Entry]":
        raise NotImplementedError

    def open(self, rel: str, *, size: int | None = None) -> "ReadHandle":
        raise NotImplementedError

    def is_file(self, rel: str) -> bool:
        try:
            return self.kind(rel) == "file"
        except UnsafePathError:
            return False

    def is_dir(self, rel: str) -> bool:
        try:
            return self.kind(rel) == "dir"
        except UnsafePathError:
            return False

    def walk_files(self, rel: str = "") -> Iterator[tuple[str, Entry]]:
        """(relative path, entry) of every regular file below ``rel``, depth first; links are yielded as links."""
        for entry in self.listdir(rel):
            path = f"{rel}/{entry.name}" if rel else entry.name
            if entry.kind == "dir":
                yield from self.walk_files(path)
            else:
                yield path, entry

    def read_bytes(self, rel: str, *, max_size: int) -> bytes:
        """The whole of a small file, refused when it is larger than ``max_size`` (nothing big is read)."""
        with self.open(rel) as h:
            if h.size > max_size:
                raise CheckpointCorruptError(f"{h.path}: {h.size} bytes, more than the {max_size} a file of this "
                                             "kind may have")
            return h.read(0, h.size)

    def read_text(self, rel: str, *, max_size: int) -> str:
        return self.read_bytes(rel, max_size=max_size).decode("utf-8", errors="replace")


class Folder(FolderReads):
    """A directory read through confined, relative paths. Cheap to create; holds no descriptors.

    Thread safety: handles may be opened and used from several threads; a :class:`Verifier` locks itself.
    """

    def __init__(self, path: str | os.PathLike, *, links: bool = False, verifier: Any = None) -> None:
        self.path = Path(path)
        self.links = links
        self.verifier = verifier

    def __repr__(self) -> str:
        return f"Folder({str(self.path)!r})"

    def display(self, rel: str = "") -> Path:
        return self.path / rel if rel else self.path

    def plain(self) -> "Folder":
        """The same folder without a verifier."""
        return Folder(self.path, links=self.links)

    def sub(self, rel: str) -> "Folder":
        """The folder ``rel`` below this one (checked now: it must be a real directory, not a link)."""
        if rel in ("", "."):
            return self
        fd, _ = self._walk(check_relative(rel, self.path) + ("",), want_dir=True)
        os.close(fd)
        return Folder(self.path / rel, links=self.links, verifier=self.verifier)

    # ------------------------------------------------------------------ resolution
    def _open_root(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path}: no such folder") from None
        except NotADirectoryError:
            raise CheckpointNotFoundError(f"{self.path}: not a folder") from None

    def _walk(self, parts: tuple[str, ...], *, want_dir: bool = False) -> tuple[int, str]:
        """(descriptor of the directory holding the last component, the last component). Caller closes."""
        fd = self._open_root()
        try:
            for i, part in enumerate(parts[:-1]):
                flags = os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC | (0 if self.links else _O_NOFOLLOW)
                try:
                    nfd = os.open(part, flags, dir_fd=fd)
                except FileNotFoundError:
                    raise CheckpointNotFoundError(f"{self.path / '/'.join(parts[:i + 1])}: no such folder") from None
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                        raise UnsafePathError(
                            f"{self.path / '/'.join(parts[:i + 1])}: is a symbolic link or not a folder; "
                            "a checkpoint is read only through real folders below its own"
                        ) from None
                    raise
                os.close(fd)
                fd = nfd
            return fd, parts[-1]
        except BaseException:
            os.close(fd)
            raise

    def lstat(self, rel: str) -> os.stat_result | None:
        """``lstat`` of ``rel`` (``None`` when it does not exist); links below the folder are not followed."""
        parts = check_relative(rel, self.path)
        try:
            fd, name = self._walk(parts)
        except CheckpointNotFoundError:
            return None
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=self.links)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def kind(self, rel: str) -> str | None:
        """``file``, ``dir``, ``link``, ``other`` or ``None`` (missing)."""
        st = self.lstat(rel)
        return None if st is None else _kind(st.st_mode)

    def size(self, rel: str) -> int:
        """Size of the regular file ``rel``; a missing file, a link or a special file is an error naming it."""
        st = self.lstat(rel)
        if st is None:
            raise CheckpointNotFoundError(f"{self.path / rel}: missing")
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{self.path / rel}: is a {_describe(st.st_mode)}, not a regular file")
        return st.st_size

    def listdir(self, rel: str = "") -> list[Entry]:
        """The entries of the folder ``rel`` (sorted by name); links are listed as ``link``."""
        fd = self._open_root() if rel in ("", ".") else None
        if fd is None:
            pfd, name = self._walk(check_relative(rel, self.path))
            try:
                fd = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC | (0 if self.links else _O_NOFOLLOW),
                             dir_fd=pfd)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{self.path / rel}: no such folder") from None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePathError(f"{self.path / rel}: is a symbolic link or not a folder") from None
                raise
            finally:
                os.close(pfd)
        try:
            out = []
            for name in sorted(os.listdir(fd)):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=self.links)
                except FileNotFoundError:
                    continue
                out.append(Entry(name, _kind(st.st_mode), st.st_size))
            return out
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ reading
    def open(self, rel: str, *, size: int | None = None) -> "ReadHandle":
        """Open the regular file ``rel`` for reading; ``size``: the size it must have."""
        parts = check_relative(rel, self.path)
        fd, name = self._walk(parts)
        try:
            flags = os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK | (0 if self.links else _O_NOFOLLOW)
            try:
                ffd = os.open(name, flags, dir_fd=fd)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{self.path / rel}: missing") from None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EMLINK):
                    raise UnsafePathError(f"{self.path / rel}: is a symbolic link; a checkpoint is read only through "
                                          "regular files inside it") from None
                if exc.errno == errno.ENXIO:  # a FIFO or socket without a writer
                    raise UnsafePathError(f"{self.path / rel}: is not a regular file") from None
                raise
        finally:
            os.close(fd)
        try:
            st = os.fstat(ffd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePathError(f"{self.path / rel}: is a {_describe(st.st_mode)}, not a regular file")
            if size is not None and st.st_size != size:
                raise CheckpointCorruptError(f"{self.path / rel}: size {st.st_size} bytes, expected {size}")
        except BaseException:
            os.close(ffd)
            raise
        handle = ReadHandle(ffd, self.path / rel, st.st_size)
        if self.verifier is not None:
            self.verifier._attach(self, rel, handle)
        return handle

def _describe(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device file"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


class ReadHandle:
    """An open regular file of known size; reads are positional (thread-safe) and bounded by the size."""

    def __init__(self, fd: int, path: Path, size: int) -> None:
        self.fd = fd
        self.path = path
        self.size = size
        self._hash: Any = None
        self._advice: list[tuple[int, int]] | None = None
        self._ahead: reading.ReadAhead | None = None

    def advise(self, spans: "list[tuple[int, int]]") -> None:
        """Say which byte ranges (start, end) this handle will read from now on (adjacent ones merged): a store that
        fetches more than a read asks for (an object store's windows) then fetches only inside them, so ranks that
        share a file's reads do not each fetch all of it. A local file takes it as a hint, and with
        ``CKPTIO_DIRECT_READS=1`` reads large ranges the page cache does not hold ahead (:mod:`.reading`)."""
        merged: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1] + ADVICE_SLACK:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self._advice = merged
        if self.fd >= 0:
            self._close_ahead()
            self._ahead = reading.start(self.fd, self.size, merged)

    def _close_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def __enter__(self) -> "ReadHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            if self._hash is not None:
                # pieces still queued for the verifier may read through this descriptor (a small hole they
                # skip is read in passing): they go first, or a reused descriptor number would feed the
                # hash another file's bytes. A piece that failed is read again when the verifier finishes.
                try:
                    self._hash.wait()
                except Exception:  # noqa: BLE001
                    pass
            self._close_ahead()
            os.close(self.fd)
            self.fd = -1

    def readinto(self, buf: Any, offset: int, *, settle: bool = True) -> None:
        """Fill all of ``buf`` (a writable buffer) from ``offset``; a short file is an error naming it.

        Under a verifier the bytes are hashed on its thread while the next piece is read. ``settle=False``
        is for a destination nobody writes to until the verifier finishes (a restore's target tensors):
        the read returns before its last pieces are hashed, so the next read overlaps them too.
        """
        view = memoryview(buf).cast("B")
        n = view.nbytes
        if offset < 0 or offset + n > self.size:
            raise CheckpointCorruptError(f"{self.path}: a read of {n} bytes at {offset} runs past its end "
                                         f"({self.size} bytes)")
        h = self._hash
        if h is None:
            self._pread(view, offset)
            return
        if (n <= _PIECE if settle else n <= _SMALL) and h.idle():
            # hashed here (CRC-32C: 60 us a MiB), cheaper than handing it to the hashing thread (a future and a
            # queue each: 0.13 s of the 0.23 s that verify: full added to a 1.8 GB restore of 2,800 pieces)
            self._pread(view, offset)
            h.update(offset, view, self)
            return
        # CRC-32C releases the GIL, so the verifier's thread hashes a piece while this one reads the next;
        # pieces reach it in file order, and a settled read waits for its own before returning, so the
        # caller's buffer is never hashed after it has it back
        for start in range(0, max(n, 1), _PIECE):
            piece = view[start:start + _PIECE]
            self._pread(piece, offset + start)
            h.submit(offset + start, piece, self)
        if settle:
            h.wait()

    def _pread(self, view: memoryview, offset: int) -> None:
        if self._ahead is not None and self._ahead.serve(view, offset):
            return
        done, n = 0, view.nbytes
        while done < n:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointCorruptError(f"{self.path}: truncated (expected {self.size} bytes)")
            done += got

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.readinto(buf, offset)
        return bytes(buf)

    def stream(self) -> "HandleStream":
        """A seekable binary file object over this handle (for readers that want one: DCP, torch.load)."""
        return HandleStream(self)
