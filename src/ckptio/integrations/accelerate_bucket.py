"""``CkptioAccelerator(..., ckptio_checkpoint_dir="s3://bucket/run")`` (``gs://``, ``az://`` alike): ``save_state()``
writes accelerate's ``checkpoint_N`` folders into object storage, through ckptio's object-store protocol
(:mod:`ckptio.integrations.framework_bucket`); ``project_dir`` stays local (accelerate's trackers write there).
"""

from __future__ import annotations

from typing import Any, Callable

from .framework_bucket import BucketRun

__all__ = ["save_state"]


def save_state(acc: Any, run: BucketRun, safe_serialization: bool, save: Callable[[str], Any]) -> str:
    """``CkptioAccelerator.save_state()`` into ``run``: every process writes what accelerate writes into its own local
    spool (``save``: accelerate's ``save_state`` into a folder; in the background with ``async_save``, the staged
    writer) and uploads it;
    the main process commits the folder and applies ``total_limit`` there. Returns the folder's URL."""
    from ..accelerate import _staged_writer, states_of
    from .framework_dirs import commit

    config = acc.project_configuration
    name = f"checkpoint_{acc.save_iteration}"
    acc.ckptio_steps.flush()
    acc._ckptio_audited(run.url).saved(acc.ckptio_steps.step, key=config.iteration)
    timer = acc.ckptio_numbers.start(step=config.iteration, folder=run.location(name))
    main, saves = acc.is_main_process, acc._ckptio_saves
    writer = run.begin(name, main, acc.wait_for_everyone)
    tmp = writer.local_path()
    if saves is not None:
        write = _staged_writer(acc, tmp, safe_serialization)
        config.iteration += 1
    else:
        auto, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False
        try:
            save(str(tmp))
        finally:
            config.automatic_checkpoint_naming = auto
    sums: dict[str, str] = {}
    step, world, steps, limit = config.iteration, acc.num_processes, acc.ckptio_steps.step, config.total_limit

    def commit_now() -> None:
        commit(writer, step=step, epoch=0, world_size=world, states=states_of(writer.files()),
               counters={"steps": steps}, name=name, sums=sums)
        run.rotate(limit, frozenset(), name)

    wrapped = timer.wrap(commit_now if main else None, background=saves is not None)
    if saves is not None:
        def background() -> None:
            write()
            sums.update(run.publish(writer, tmp, main))

        saves.start(run.storage.root / name, background, wrapped)
        timer.returned()
        return run.location(name)
    sums.update(run.publish(writer, tmp, main))
    if wrapped is not None:
        wrapped()
    acc.wait_for_everyone()  # committed before any process reads it
    acc._ckptio_log()
    return run.location(name)

