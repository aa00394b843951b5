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

from typing import Any

from .framework_bucket import BucketRun
from .hf_trainer_save import NAME, TRAINER_STATE, commit_facts, states_of

__all__ = ["bucket_run", "save_checkpoint"]


def bucket_run(url: str) -> BucketRun:
    """The Trainer's ``checkpoint-N`` folders under ``url``."""
    return BucketRun(url, NAME, "Trainer's output_dir", "save_total_limit")


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
        sums.update(run.publish(writer, tmp, should))

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

        saves.start(run.storage.root / name, background, wrapped)
        timer.returned()
        return
    publish()
    if wrapped is not None:
        wrapped()
    me.accelerator.wait_for_everyone()  # committed before any rank reads it
    timer.returned()
