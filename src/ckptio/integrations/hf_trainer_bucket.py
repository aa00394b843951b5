"""``CkptioTrainer(..., ckptio_checkpoint_dir="s3://bucket/run")`` (``gs://``, ``az://`` alike): the Trainer's
``checkpoint-N`` folders kept in object storage, while ``output_dir`` (logs, ``runs/``) stays local.

Each folder is a step of ckptio's object-store protocol (:mod:`ckptio.storage.objstore`): rank 0 begins it (whatever
sat under its name removed, manifest first; marked in progress), every rank writes its files as the Trainer does into
a local spool and uploads them, then rank 0 writes the manifest last with a create-only write, holding the folder's
lease (one job per ``ckptio_checkpoint_dir``). A killed save leaves an uncommitted folder that is never resumed from
and is swept at the next run's first save.

A resume (``resume_from_checkpoint=True``, a ``checkpoint-N`` URL, the best model at the end) copies the folder into a
private local one, checked against the manifest's checksums, and checks it as a local checkpoint before the Trainer
reads it. ``save_total_limit`` counts committed folders only and deletes a folder manifest first.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from .. import _dist
from ..errors import CheckpointError, ConfigError
from .hf_trainer_save import NAME, TRAINER_STATE, commit_facts, states_of

__all__ = ["BucketRun", "save_checkpoint"]

log = logging.getLogger("ckptio")


class BucketRun:
    """The ``checkpoint-N`` folders of one run under ``url`` in object storage (see the module's documentation)."""

    def __init__(self, url: str) -> None:
        from ..storage import OBJECT_SCHEMES, open_storage, url_scheme

        if url_scheme(str(url)) not in OBJECT_SCHEMES:
            raise ConfigError(f"ckptio_checkpoint_dir={url!r}: an object store location is expected "
                              f"({', '.join(s + '://' for s in OBJECT_SCHEMES)}bucket/prefix); local checkpoints go "
                              "to the Trainer's output_dir")
        self.url = str(url).rstrip("/")
        self.storage: Any = open_storage(self.url)
        self._lease: Any = None
        self._copies: list[Path] = []

    def location(self, name: str) -> str:
        """``url/name``, as the Trainer's state records a checkpoint."""
        return f"{self.url}/{name}"

    def name_of(self, location: str) -> str | None:
        """The ``checkpoint-N`` name of ``location`` when it is a folder directly under this run's url."""
        head, _, name = str(location).rstrip("/").rpartition("/")
        return name if head == self.url and NAME.match(name) else None

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

    def release(self) -> None:
        """Give up the lease (the end of ``train``) and remove the local copies read in this run."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        for copy in self._copies:
            shutil.rmtree(copy, ignore_errors=True)
        self._copies.clear()

    def committed(self) -> list[str]:
        """The committed ``checkpoint-N`` folders, newest first."""
        from ..storage.objstore.replace import committed

        return [name for _, name in self._numbered() if committed(self.storage, name)]

    def _numbered(self) -> list[tuple[int, str]]:
        entries = self.storage.folder().listdir()
        return sorted(((int(m.group(1)), e.name) for e in entries if e.kind == "dir" and (m := NAME.match(e.name))),
                      reverse=True)

    def rotate(self, limit: int | None, keep: frozenset[str], saved: str) -> list[str]:
        """At most ``limit`` committed folders, the oldest others deleted (manifest first); never ``saved``, the
        newest or those in ``keep``. A folder without its manifest is neither counted nor deleted."""
        from .framework_dirs import beyond_limit

        if not limit or limit <= 0:
            return []
        doomed = beyond_limit(self.committed(), limit, keep=keep, saved=saved)
        for name in doomed:
            log.info("ckptio: deleting %s (save_total_limit=%d)", self.location(name), limit)
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
        there is no ``checkpoint-N`` folder; :class:`~ckptio.errors.NoUsableCheckpointError` when none is usable."""
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
            raise ConfigError(f"{location}: not a checkpoint-N folder of ckptio_checkpoint_dir {self.url}")
        return self.fetch(name, check)


def save_checkpoint(me: Any, trial: Any, saves: Any, run: BucketRun) -> None:
    """The Trainer's ``_save_checkpoint`` into ``run`` (in the background through ``saves`` when it is given): the
    same writers as a local save (:mod:`ckptio.integrations.hf_trainer_save`), each rank's files spooled locally."""
    from .framework_dirs import commit
    from .hf_trainer_save import _staged_writer, _store_callback_states, _writer

    if saves is not None:
        saves.wait()
    step = me.state.global_step
    name = f"checkpoint-{step}"
    timer = me.ckptio_numbers.start(step=step, folder=run.location(name))
    if me.hp_search_backend is None and trial is None:
        me.store_flos()
    should = me.args.should_save
    writer = run.begin(name, should, me.accelerator.wait_for_everyone)
    tmp = writer.local_path()
    write = _staged_writer(me, tmp, saves) if saves is not None else _writer(me, tmp)
    if saves is None:
        write()
    best = me.state.best_global_step
    if best and (best == step or f"checkpoint-{best}" in run.committed()):
        me.state.best_model_checkpoint = run.location(f"checkpoint-{best}")
    if not me.args.save_only_model:
        me._save_scaler(str(tmp))
        me._save_rng_state(str(tmp))
    if should:
        _store_callback_states(me)
        me.state.save_to_json(str(tmp / TRAINER_STATE))
    sums: dict[str, str] = {}

    def publish() -> None:  # every rank: its files uploaded, their checksums to rank 0
        rels = [p.relative_to(tmp).as_posix() for p in sorted(tmp.rglob("*")) if p.is_file()]
        writer.files()
        for part in _dist.all_gather_object({rel: writer.checksum_of(rel) for rel in rels}):
            sums.update(part)
        if not should:
            writer.abort_spool()

    commit_now = None
    if should:
        facts = (step, int(me.state.epoch or 0), me.args.world_size) + commit_facts(me)

        def commit_now() -> None:
            at, epoch, world, metrics, keep, limit = facts
            commit(writer, step=at, epoch=epoch, world_size=world, states=states_of(writer.files()), metrics=metrics,
                   name=name, sums=sums)
            run.rotate(limit, keep, name)

    wrapped = timer.wrap(commit_now, background=saves is not None)
    if saves is not None:
        def background() -> None:
            write()
            publish()

        saves.start(run.location(name), background, wrapped)
        timer.returned()
        return
    publish()
    if wrapped is not None:
        wrapped()
    me.accelerator.wait_for_everyone()  # committed before any rank reads it
    timer.returned()
