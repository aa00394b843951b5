"""The storage interface: every byte ckptio writes goes through a :class:`FolderWriter` or a
:class:`FileWriter`, and every byte it reads through a :class:`~ckptio.storage.confined.Folder`.

One implementation exists today, :mod:`ckptio.storage.local` (POSIX: temporary folder, fsync, rename).
The interface is shaped so that an object store fits without special cases in the callers:

* a new step (or any new folder: a conversion's output, an unpacked archive) is written file by file
  through a :class:`FolderWriter` and becomes visible only at :meth:`FolderWriter.commit`. Locally that
  is a rename of a temporary folder; on an object store, where there is no rename, it is the manifest
  written last with a conditional write (``If-None-Match``), so discovery never trusts a step without
  one. Either way the callers write the same calls in the same order;
* files are written as streams with a running checksum (:class:`WriteStream`), so no file is read back
  to checksum it and a multipart upload can stream as the bytes come;
* a library that insists on writing to a path of its own (``transformers``' ``save_pretrained``,
  ``torch.save`` inside DCP) writes into :meth:`FolderWriter.local_path`; an object store uploads what
  appears there when the folder is committed;
* deleting a step, the ``LATEST``/``BEST`` pointers, the listing and the lock are methods of
  :class:`Storage`, the checkpoint folder itself.

Call sequence of a save on N ranks: rank 0 calls :meth:`Storage.begin_step` and broadcasts the
writer's :attr:`FolderWriter.token`; every other rank calls :meth:`Storage.attach_step` with it; each
rank writes its own files and closes them; after a barrier rank 0 writes the manifest with
:meth:`FolderWriter.commit`. Writers are not thread-safe as a whole, but distinct files may be written
from distinct threads at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Self, runtime_checkable

from .confined import Folder

__all__ = ["WriteStream", "FolderWriter", "FileWriter", "Storage"]


@runtime_checkable
class WriteStream(Protocol):
    """A file being written once, front to back, checksummed as it goes."""

    @property
    def error(self) -> OSError | None:
        """The first ``OSError`` a write raised (some callers, such as torch's zip writer, swallow it)."""

    def write(self, data: Any) -> int:
        """Write all of ``data`` (any buffer) or raise; returns its length."""

    def fileno(self) -> int:
        """A descriptor for ``fsync`` where there is one (``io.UnsupportedOperation`` elsewhere)."""

    def close(self) -> str:
        """Make the file durable and return its checksum (``crc32c:xxxxxxxx``). Idempotent."""

    @property
    def digest(self) -> str:
        """The checksum of the bytes written so far."""

    def __enter__(self) -> Self: ...

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """Close on success; discard (not durable) when the block raised."""


class ClosedOnSuccess:
    """``with`` for a write stream: :meth:`close` (durable) when the block succeeds, :meth:`discard` when it raised."""

    def close(self) -> Any:
        raise NotImplementedError

    def discard(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


class FolderWriter(Protocol):
    """A new folder written file by file; nothing of it is visible under its name before :meth:`commit`."""

    name: str
    """The folder's final name."""
    token: str
    """What another rank passes to :meth:`Storage.attach_step` to write into the same folder."""

    def open(self, rel: str) -> WriteStream:
        """A new file ``rel`` (a relative path; folders are created as needed)."""

    def write_bytes(self, rel: str, data: bytes) -> str:
        """Write a whole small file; returns its checksum."""

    def link(self, rel: str, source: str, size: int) -> bool:
        """Make ``rel`` hold the bytes of ``source`` (``step/path``, a committed file of ``size`` bytes in the same
        checkpoint folder) without writing them: a hard link locally, a reference in a bucket. ``False``: it
        cannot here; the caller writes the file."""

    def local_path(self, rel: str = "") -> Path:
        """A local folder inside this one, for libraries that write to paths themselves."""

    def rename(self, rel: str, new_rel: str) -> None:
        """Rename a file of this folder (DCP writes ``.metadata`` under a temporary name first)."""

    def exists(self, rel: str) -> bool: ...

    def reader(self, rel: str = "") -> Any:
        """A read-only folder (:class:`~ckptio.storage.confined.FolderReads`) of what every rank has written
        into ``rel`` so far (collective use: call after a barrier; a remote writer publishes its local
        files first)."""

    def checksum_of(self, rel: str) -> str:
        """The checksum of a file a library wrote into :meth:`local_path` (the streams return their own)."""

    def files(self) -> dict[str, int]:
        """Every file written so far (relative path -> size), on every rank's behalf (call after a barrier)."""

    def commit(self, manifest: tuple[str, bytes] | None = None) -> Path:
        """Make the folder visible under its name, with ``manifest`` (name, bytes) written last."""

    def abort(self) -> None:
        """Remove everything written; the folder never becomes visible."""


class FileWriter(Protocol):
    """A new single file (a ``.nemo``, a Lightning ``.ckpt``) that appears whole at :meth:`commit`."""

    stream: WriteStream

    def commit(self) -> Path: ...

    def abort(self) -> None: ...


class Storage(Protocol):
    """A checkpoint folder (``checkpoint_dir``): where step directories, pointers and the lock live."""

    root: Path

    def folder(self, rel: str = "", *, verifier: Any = None) -> Folder:
        """Read access, confined to ``rel`` inside the root (see :mod:`ckptio.storage.confined`)."""

    def session(self) -> Any:
        """A context manager: the folders opened while it lasts (one restore) may share what they listed and read
        (an object store lists the folder and a step once; nothing to share on a local disk)."""

    def share_step(self, name: str) -> None:
        """Collective, within a :meth:`session` (every rank, in the same order): the listings and small files of the
        step ``name`` that every rank reads are read by rank 0 and sent to the others (an object store; nothing on a
        local disk)."""

    def begin_step(self, name: str) -> FolderWriter:
        """Rank 0: start writing the step directory ``name``."""

    def attach_step(self, token: str, name: str) -> FolderWriter:
        """Other ranks: write into the step rank 0 began."""

    def remove_step(self, name: str) -> None:
        """Delete a committed step so that no crash leaves a half-deleted one that discovery could take."""

    def remove_part(self, name: str, rel: str) -> None:
        """Remove the folder or file ``rel`` inside the step ``name`` (its manifest no longer refers to it)."""

    def sweep(self, older_than_s: float = 0.0) -> list[Path]:
        """Remove leftovers of interrupted saves and deletions (at least ``older_than_s`` old); returns what
        was removed."""

    def write_pointer(self, name: str, target: str) -> None: ...

    def write_small(self, name: str, data: bytes) -> None:
        """Replace the small file ``name`` at the root whole: a reader sees the old bytes or the new, never a mix."""

    def read_pointer(self, name: str) -> str | None:
        """The step name the pointer ``name`` holds (``None`` without one); a pointer that does not name a
        direct child is a :class:`~ckptio.CheckpointCorruptError`."""

    def lock(self) -> Any:
        """The folder's writer lock (``acquire``/``release``; shared within a process, refused to others)."""

    def check_writable(self) -> None:
        """Refuse, naming the folder, one this process could not save into (a read-only filesystem, no permission, a
        bucket that does not exist); cheap, and silent when it cannot tell (the first save then says why)."""
