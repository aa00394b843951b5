"""Writing a folder to object storage: files uploaded as the store's backend does it (S3: spooled and sent in parts as
they are written; GCS, Azure: from memory, see :mod:`.upload`), a step committed by its manifest, written last with
a create-only condition."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError
from ..base import ClosedOnSuccess
from ..confined import check_relative
from ..lock import Scratch
from ._store import MANIFEST, PENDING, ObjectPath, PreconditionFailed

if TYPE_CHECKING:
    from .reader import ObjectFolder
    from . import ObjectStorage


class ObjectFolderWriter:
    """A step (or any new folder) written object by object; committed by its manifest, written last."""

    def __init__(self, storage: "ObjectStorage", name: str) -> None:
        self.storage, self.name, self.token = storage, name, name
        self.store = storage.store
        self.prefix = storage._key(name)
        self._scratch: Scratch | None = None
        self._scratch_lock = threading.Lock()
        self._local_sums: dict[str, str] = {}
        self._made: dict[str, tuple[int, str]] = {}  # see written()
        self._made_lock = threading.Lock()
        self.regions = self.store.spools
        """Whether a file of :meth:`open` may be written as regions by several threads (see :attr:`Bucket.spools`)."""
        self.writes_whole = True
        """A file of :meth:`open` becomes its object whole when its stream closes (nothing to fsync, no need of a
        temporary name and a rename: a copy and a delete here), in a step :meth:`ObjectStorage.begin_step` emptied."""

    @property
    def spool(self) -> Path:
        """This writer's local scratch folder, made when first needed (an S3 upload's spool, :meth:`local_path`):
        a save to a store that uploads from memory makes none."""
        with self._scratch_lock:  # files are opened on several threads: one folder (a second would be collected)
            if self._scratch is None:
                # ranks other than the committing one never call commit/abort: their spool goes with the writer; a
                # killed process's is removed by the next process that spools (ckptio.storage.scratch)
                self._scratch = Scratch(f"ckptio-{self.store.path_type.scheme}-{self.name}-")
            return self._scratch.path

    @property
    def _local(self) -> Path:
        return self.spool / "local"

    def _drop_spool(self) -> None:
        if self._scratch is not None:
            self._scratch.remove()

    def _where(self, rel: str) -> ObjectPath:
        return self.storage.root / self.name / rel  # type: ignore[return-value]

    def _key(self, rel: str) -> str:
        return "/".join((self.prefix, *check_relative(rel, self._where(""))))

    def open(self, rel: str) -> Any:
        key = self._key(rel)
        stream = self.store.open_stream(self.spool / "streams" / uuid.uuid4().hex if self.store.spools else None, key)
        return _Recorded(stream, rel, self._record)

    def _record(self, rel: str, size: int, digest: str) -> None:
        with self._made_lock:
            self._made[rel] = (size, digest)

    def written(self) -> dict[str, tuple[int, str]]:
        """Every object this writer made in the step (this rank's files, :meth:`local_path`'s uploaded first):
        relative path -> (size, checksum), as the store confirmed them when each was made (a stream's object once its
        close succeeded, its size and CRC-32C checked by the store where it checks them), renames followed. The
        whole step is the union of every rank's (with the files other steps hold for it): what rank 0's commit
        lists without a listing. A file is an object only once made here, every write of the step goes through
        a writer, and :meth:`ObjectStorage.begin_step` emptied the step's prefix under the folder's lease: no object
        of the step is missing from the union."""
        self._upload_local()
        with self._made_lock:
            return dict(self._made)

    def write_bytes(self, rel: str, data: bytes) -> str:
        with self.open(rel) as stream:
            stream.write(data)
        return stream.close()

    def link(self, rel: str, source: str, size: int) -> bool:
        """A reference instead of a copy: ``True`` when ``source`` (``step/path``) is an object of ``size`` bytes in
        the folder; the step's manifest then names it for ``rel`` (``shared``; see :mod:`.refs`)."""
        from ... import _faults
        from .refs import check_source

        check_relative(rel, self._where(""))
        _faults.point("save.before_link")
        return check_source(self.storage, source, size)

    def local_path(self, rel: str = "") -> Path:
        """A local folder whose files are uploaded at :meth:`files`/:meth:`commit` (rank 0 writes there)."""
        path = self._local / rel if rel else self._local
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _upload_local(self) -> None:
        from ..checksum import file_checksum

        if self._scratch is not None and self._local.is_dir():
            for path in sorted(self._local.rglob("*")):
                rel = path.relative_to(self._local).as_posix()
                if path.is_file() and not path.is_symlink() and rel not in self._local_sums:
                    size, digest = path.stat().st_size, file_checksum(path)
                    self.store.upload_file(path, self._key(rel))
                    self._local_sums[rel] = digest
                    self._record(rel, size, digest)

    def reader(self, rel: str = "") -> "ObjectFolder":
        """What every rank has uploaded under ``rel`` so far (this rank's local files are uploaded first)."""
        from .reader import ObjectFolder

        self._upload_local()
        return ObjectFolder(self.store, f"{self.prefix}/{rel}" if rel else self.prefix)

    def checksum_of(self, rel: str) -> str:
        self._upload_local()
        if rel not in self._local_sums:
            raise CheckpointError(f"{self._where(rel)}: written by another writer, its checksum is not known here")
        return self._local_sums[rel]

    def rename(self, rel: str, new_rel: str) -> None:
        src, dst = self._key(rel), self._key(new_rel)
        self.store.copy(src, dst)
        self.store.delete(src)
        with self._made_lock:
            made = self._made.pop(rel, None)
            if made is not None:
                self._made[new_rel] = made

    def exists(self, rel: str) -> bool:
        return self.store.head(self._key(rel)) is not None

    def files(self) -> dict[str, int]:
        """Every object written so far under this step, by every rank (files of :meth:`local_path` uploaded first)."""
        self._upload_local()
        return {rel: obj.size for rel, obj in self.storage._objects(self.prefix).items()
                if rel not in (MANIFEST, PENDING)}

    def mark_pending(self) -> None:
        """Write the step's in-progress mark (before any of its files; see :data:`ckptio.engine.manifest.PENDING_NAME`)."""
        self.store.put(self._key(PENDING), b"")

    def commit(self, manifest: tuple[str, bytes] | None = None) -> ObjectPath:
        self._upload_local()
        if manifest is not None:
            from ... import _faults

            _faults.point("commit.before_manifest")
            name, data = manifest
            try:
                self.store.put(self._key(name), data, if_absent=True)
            except PreconditionFailed:
                if self._landed(name, data):
                    pass  # this writer's own upload, whose answer was lost and which the client tried again
                else:
                    raise CheckpointError(f"{self._where('')}: another writer committed this step first; this "
                                          "save is not committed (two jobs must not share a checkpoint_dir)") from None
            try:  # committed: the mark goes (a leftover one is harmless, the manifest decides)
                self.store.delete(self._key(PENDING))
            except Exception:  # noqa: BLE001
                pass
        self._drop_spool()
        return self._where("").parent / self.name  # type: ignore[return-value]

    def _landed(self, name: str, data: bytes) -> bool:
        """Whether the object ``name`` of this step holds exactly ``data`` (a create-only write refused because an
        earlier try of the same write landed)."""
        try:
            there, _ = self.store.get(self._key(name), len(data) + 1)
        except CheckpointError:
            return False
        return there == data

    def abort(self) -> None:
        self._drop_spool()
        self.storage._delete_prefix(self.prefix, manifest_first=True)

    def abort_spool(self) -> None:
        """Drop the local spool only: objects already uploaded stay (adding files to a committed step)."""
        self._drop_spool()


class _Recorded(ClosedOnSuccess):
    """A stream of :meth:`ObjectFolderWriter.open`: the store's own, whose object is recorded in its writer
    (:meth:`ObjectFolderWriter.written`) once its :meth:`close` succeeded, never after a :meth:`discard`. Everything
    else is the store's stream (its ``write`` itself: no call in between)."""

    def __init__(self, stream: Any, rel: str, record: Any) -> None:
        self.stream, self.rel, self._record, self._discarded = stream, rel, record, False
        self.write = stream.write
        self.tell = stream.tell

    def close(self) -> str:
        digest: str = self.stream.close()
        if not self._discarded:
            self._record(self.rel, self.stream.size, digest)
        return digest

    def discard(self) -> None:
        self._discarded = True
        self.stream.discard()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)
