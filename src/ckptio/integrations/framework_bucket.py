"""Checkpoint folders of a framework's own layout (the Trainer's ``checkpoint-N``, accelerate's ``checkpoint_N``) kept
in object storage by the framework integrations (``ckptio_checkpoint_dir="s3://bucket/run"``; ``gs://``, ``az://`` alike).

Each folder is a step of ckptio's object-store protocol (:mod:`ckptio.storage.objstore`): the main process begins it
(whatever sat under its name removed, manifest first; marked in progress), every process writes its files as the
framework does into a local spool and uploads them (:meth:`BucketRun.publish`), then the main process writes the
manifest last with a create-only write, holding the folder's lease (one job per location). A killed save leaves an
uncommitted folder that is never loaded and is swept at the run's first save.

A load copies the folder into a private local one, checked against the manifest's checksums and then by the
integration's own check of a local folder, before the framework reads it. Retention counts committed folders only and
deletes a folder manifest first.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from .. import _dist
from ..errors import CheckpointError, ConfigError

__all__ = ["BucketRun"]

log = logging.getLogger("ckptio")


class BucketRun:
    """The numbered folders (``pattern``: their names, one group the number) of one run under ``url`` in object
    storage; ``setting`` names the option in errors (see the module's documentation)."""

    def __init__(self, url: str, pattern: re.Pattern[str], setting: str, limit_setting: str) -> None:
        from ..storage import OBJECT_SCHEMES, open_storage, url_scheme

        if url_scheme(str(url)) not in OBJECT_SCHEMES:
            raise ConfigError(f"ckptio_checkpoint_dir={url!r}: an object store location is expected "
                              f"({', '.join(s + '://' for s in OBJECT_SCHEMES)}bucket/prefix); local checkpoints go "
                              f"to the {setting}")
        self.url = str(url).rstrip("/")
        self.pattern, self.limit_setting = pattern, limit_setting
        self.storage: Any = open_storage(self.url)
        self._lease: Any = None
        self._copies: list[Path] = []
        self.parent: BucketRun | None = None
        """The run this one is a part of (a hyperparameter search trial's, under the run's url)."""

    def location(self, name: str) -> str:
        """``url/name``, as the Trainer's state records a checkpoint."""
        return f"{self.url}/{name}"

    def name_of(self, location: str) -> str | None:
        """The folder name of ``location`` when it is a folder directly under this run's url."""
        head, _, name = str(location).rstrip("/").rpartition("/")
        return name if head == self.url and self.pattern.match(name) else None

    # -------------------------------------------------------------------------------------------- writing
    def begin(self, name: str, should_save: bool, wait_for_everyone: Callable[[], None]) -> Any:
        """Collective: the writer of the new folder ``name`` on every rank; rank 0 (``should_save``) takes the lease
        and sweeps what killed saves left before its first save, and begins the folder before any rank writes."""
        writer = None
        if should_save:
            if self._lease is None:
                self._lease = self.storage.lock()
                self._lease.acquire()
                for leftover in self.storage.sweep():
                    log.info("ckptio: removed the leftover of an interrupted save: %s", leftover)
            writer = self.storage.begin_step(name)
        wait_for_everyone()
        return writer if writer is not None else self.storage.attach_step(name, name)

    def upload(self, writer: Any, spool: Path, main: bool) -> dict[str, str]:
        """This process's files of ``spool`` (its writer's local folder) uploaded: their checksums. The other
        processes than the main one drop their spool."""
        rels = [p.relative_to(spool).as_posix() for p in sorted(spool.rglob("*")) if p.is_file()]
        writer.files()  # uploads them
        sums = {rel: writer.checksum_of(rel) for rel in rels}
        if not main:
            writer.abort_spool()
        return sums

    def publish(self, writer: Any, spool: Path, main: bool) -> dict[str, str]:
        """Collective: :meth:`upload` on every process (a failure raised on every process); returns every process's
        checksums of what it uploaded (for the main one's manifest)."""
        _, parts = _dist.agree(f"uploading {self.location(writer.name)}", lambda: self.upload(writer, spool, main),
                               share=lambda sums: sums)
        return _merged(parts)

    def save_in_background(self, saves: Any, writer: Any, write: Callable[[], None], main: bool,
                           commit: Callable[[], None] | None, sums: dict[str, str]) -> None:
        """The folder of ``writer`` written (``write``: this process's part into its spool) and uploaded in the
        background through ``saves`` (a :class:`~ckptio.integrations.framework_async.FolderSaves`), every process's
        checksums put in ``sums`` in the round that tells every process all parts are in, then ``commit`` (on the
        main process; ``None`` elsewhere). The upload runs no collective of its own: a process whose part failed
        answers that round like the others, and the failure is raised on every process."""
        spool = writer.local_path()

        def part() -> dict[str, str]:
            write()
            return self.upload(writer, spool, main)

        saves.start(self.storage.root / writer.name, part, commit, gathered=lambda parts: sums.update(_merged(parts)))

    def release(self) -> None:
        """Give up the lease (the end of training) and remove the local copies read in this run."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self.drop_copies()

    def drop_copies(self) -> None:
        """Remove the local copies read so far (the framework has loaded them)."""
        for copy in self._copies:
            shutil.rmtree(copy, ignore_errors=True)
        self._copies.clear()

    def committed(self) -> list[str]:
        """The committed numbered folders, newest first."""
        from ..storage.objstore.replace import committed

        return [name for _, name in self._numbered() if committed(self.storage, name)]

    def _numbered(self) -> list[tuple[int, str]]:
        entries = self.storage.folder().listdir()
        found = ((m, e.name) for e in entries if e.kind == "dir" and (m := self.pattern.match(e.name)))
        return sorted(((int(m.group(1)), name) for m, name in found), reverse=True)

    def rotate(self, limit: int | None, keep: frozenset[str], saved: str) -> list[str]:
        """At most ``limit`` committed folders, the oldest others deleted (manifest first); never ``saved``, the
        newest or those in ``keep``. A folder without its manifest is neither counted nor deleted."""
        from .framework_dirs import beyond_limit

        if not limit or limit <= 0:
            return []
        doomed = beyond_limit(self.committed(), limit, keep=keep, saved=saved)
        for name in doomed:
            log.info("ckptio: deleting %s (%s=%d)", self.location(name), self.limit_setting, limit)
            self.storage.remove_step(name)
        return doomed

    # -------------------------------------------------------------------------------------------- reading
    def fetch(self, name: str, check: Callable[[Path], None]) -> Path:
        """A private local copy of the folder ``name``, checked against its manifest's checksums and by ``check``
        (removed when the run releases it). A folder without a manifest is refused: a save cut short."""
        from ..errors import CheckpointCorruptError
        from ..storage.objstore.replace import committed
        from ..storage.transfer import copy_down

        if not committed(self.storage, name):
            raise CheckpointCorruptError(f"{self.location(name)}: no manifest (a save cut short, or not a ckptio "
                                         "checkpoint): never resumed from")
        root = Path(tempfile.mkdtemp(prefix="ckptio-hf-"))
        self._copies.append(root)
        copy = copy_down(self.location(name), root / name)
        check(copy)
        return copy

    def newest(self, check: Callable[[Path], None]) -> tuple[str, Path] | None:
        """The newest folder that is committed, whole and passes ``check`` (its name and local copy); ``None`` when
        there is no numbered folder; :class:`~ckptio.errors.NoUsableCheckpointError` when none is usable."""
        from .framework_dirs import newest

        skipped: list[tuple[str, str]] = []
        for _, name in self._numbered():
            try:
                copy = self.fetch(name, check)
            except CheckpointError as exc:
                skipped.append((name, str(exc)))
            else:
                newest(self.url, ([copy], skipped))  # the skipped ones logged with their reasons
                return name, copy
        newest(self.url, ([], skipped))
        return None

    def resolve(self, location: str, check: Callable[[Path], None]) -> Path:
        """The local copy of the checkpoint at ``location`` (a folder of this run)."""
        name = self.name_of(location)
        if name is None:
            raise ConfigError(f"{location}: not a checkpoint folder of ckptio_checkpoint_dir {self.url}")
        return self.fetch(name, check)


def _merged(parts: list[dict[str, str]]) -> dict[str, str]:
    """One mapping of every process's checksums (each process uploads files of its own)."""
    return {rel: digest for part in parts for rel, digest in part.items()}
