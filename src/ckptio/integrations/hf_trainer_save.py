"""How ``CkptioTrainer`` (:mod:`ckptio.hf_trainer`) writes a ``checkpoint-N`` folder: every rank into one hidden
folder, rank 0 committing it with its manifest and then applying ``save_total_limit``; synchronously, or with
``async_save`` staged on the training thread and written, committed and rotated in the background
(:mod:`ckptio.integrations.framework_async`); with ``ckptio_checkpoint_dir``, into object storage
(:func:`save_to_bucket`).

In the background the Trainer's own writers run on the staged copies: ``Trainer._save`` with the staged state dict
(``save_pretrained``: weights, configuration, tokenizer, ``training_args.bin``), then ``torch.save`` of the staged
optimizer and scheduler states, as ``_save_optimizer_and_scheduler`` writes them. The RNG states, the scaler and
``trainer_state.json`` are small and must show the instant of the save: they are written on the training thread.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["NAME", "TRAINER_STATE", "OPTIMIZER", "SCHEDULER", "WEIGHTS", "save_checkpoint", "bucket_run",
           "trial_run", "save_to_bucket"]

NAME = re.compile(r"^checkpoint-(\d+)$")
"""A Trainer checkpoint's folder name; its group is the global step."""
TRAINER_STATE, OPTIMIZER, SCHEDULER = "trainer_state.json", "optimizer.pt", "scheduler.pt"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
           "adapter_model.safetensors", "adapter_model.bin")
"""The files that hold a Trainer checkpoint's weights (one of them is there)."""


def save_checkpoint(me: Any, trial: Any, saves: Any, complete: Callable[[Path], None]) -> None:
    """The Trainer's ``_save_checkpoint`` for ``me`` (a ``CkptioTrainerMixin``): in the background through ``saves``
    (a :class:`~ckptio.integrations.framework_async.FolderSaves`), or now when it is ``None``. ``complete`` checks a folder for
    retention."""
    if saves is not None:
        saves.wait()  # the previous save is committed (its folder is there) and its staging buffers are free
    timer = me.ckptio_numbers.start(step=me.state.global_step, folder=Path(me._get_output_dir(trial=trial)) /
                                     f"checkpoint-{me.state.global_step}")
    if me.hp_search_backend is None and trial is None:
        me.store_flos()
    run_dir = Path(me._get_output_dir(trial=trial))
    final = run_dir / f"checkpoint-{me.state.global_step}"
    tmp = run_dir / f".{final.name}.tmp-{me.state.global_step & 0xFFFFFFFF:08x}"
    if me.args.should_save:
        if not me._ckptio_swept:
            from ..storage.posix import sweep_leftovers

            me._ckptio_swept = True
            sweep_leftovers(run_dir)
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier attempt at this step, killed
        tmp.mkdir(parents=True)
    me.accelerator.wait_for_everyone()
    write = _staged_writer(me, tmp, saves) if saves is not None else _writer(me, tmp)
    if saves is None:
        write()
    if me.state.best_global_step:
        best = run_dir / f"checkpoint-{me.state.best_global_step}"
        if me.state.best_global_step == me.state.global_step or best.is_dir():
            me.state.best_model_checkpoint = str(best)
    if not me.args.save_only_model:
        me._save_scaler(str(tmp))
        me._save_rng_state(str(tmp))
    commit = None
    if me.args.should_save:
        _store_callback_states(me)
        me.state.save_to_json(str(tmp / TRAINER_STATE))
        commit = _committer(me, run_dir, final, tmp, complete)
    commit = timer.wrap(commit, background=saves is not None)
    if saves is not None:
        saves.start(final, write, commit)
        return timer.returned()
    me.accelerator.wait_for_everyone()  # every rank's files are in
    if commit is not None:
        commit()
    me.accelerator.wait_for_everyone()  # committed before any rank reads it
    timer.returned()
    if me.args.push_to_hub:
        me._push_from_checkpoint(str(final))


def _writer(me: Any, tmp: Path) -> Callable[[], None]:
    """The Trainer's own writes of the model, optimizer and scheduler, from the live states."""
    def write() -> None:
        me.save_model(str(tmp), _internal_call=True)
        if not me.args.save_only_model:
            me._save_optimizer_and_scheduler(str(tmp))

    return write


def _staged_writer(me: Any, tmp: Path, saves: Any) -> Callable[[], None]:
    """The same writes from copies of the states taken now, for the background thread."""
    from .framework_async import reached_writing

    should, full = me.args.should_save, not me.args.save_only_model
    others = {"optimizer": me.optimizer.state_dict(), "scheduler": me.lr_scheduler.state_dict()} if should and full \
        else {}
    (weights,), others = saves.stage([me.model.state_dict() if should else {}], [me.model], **others)

    def write() -> None:
        if should:
            me._save(str(tmp), state_dict=weights)
        reached_writing()
        if should and full:
            torch.save(others["optimizer"], tmp / OPTIMIZER)
            torch.save(others["scheduler"], tmp / SCHEDULER)

    return write


def _store_callback_states(me: Any) -> None:
    from transformers.trainer_callback import ExportableState

    for cb in [c for c in me.callback_handler.callbacks + [me.control] if isinstance(c, ExportableState)]:
        name, state = cb.__class__.__name__, cb.state()
        if isinstance(me.state.stateful_callbacks[name], list):
            me.state.stateful_callbacks[name].append(state)
        else:
            me.state.stateful_callbacks[name] = state


def _committer(me: Any, run_dir: Path, final: Path, tmp: Path, complete: Callable[[Path], None]) -> Callable[[], None]:
    """Rank 0's commit of ``tmp`` as ``final`` and the retention after it, with what they need of the Trainer's state
    read now (training goes on changing it while a background save commits)."""
    from .framework_dirs import commit, remove_oldest
    from ..storage.local import LocalFolderWriter

    step, epoch, world = me.state.global_step, int(me.state.epoch or 0), me.args.world_size
    metrics, keep, limit = commit_facts(me)

    def run() -> None:
        writer = LocalFolderWriter(final, tmp)
        commit(writer, step=step, epoch=epoch, world_size=world, states=states_of(writer.files()), metrics=metrics)
        remove_oldest(run_dir, NAME, limit, keep=keep, check=complete, saved=final.name, setting="save_total_limit")

    return run


def commit_facts(me: Any) -> tuple[dict[str, float], frozenset[str], int | None]:
    """What a commit needs of the Trainer's state, read now (a background commit runs while training changes it):
    the metric for the best model at this step (for the manifest), the best checkpoint's name (kept by retention)
    and ``save_total_limit``."""
    step = me.state.global_step
    metrics = {}
    key = me.args.metric_for_best_model
    if key:
        key = key if key.startswith("eval_") else f"eval_{key}"
        for entry in me.state.log_history:
            if entry.get("step") == step and isinstance(entry.get(key), (int, float)):
                metrics[key] = float(entry[key])
    best = me.state.best_model_checkpoint
    keep = frozenset({str(best).rstrip("/").rpartition("/")[2]} if best else ())
    return metrics, keep, me.args.save_total_limit


def states_of(files: dict[str, int]) -> dict[str, Any]:
    """The manifest's states of a checkpoint holding ``files``: the model's weights, the optimizer and scheduler."""
    from ..engine.manifest import StateEntry

    weights = next((n for n in WEIGHTS if n in files), None)
    states = {"model": StateEntry("model", "hf", weights)} if weights else {}
    if OPTIMIZER in files:
        states.update(optimizer=StateEntry("optimizer", "pt", OPTIMIZER),
                      lr_scheduler=StateEntry("object", "pt", SCHEDULER))
    return states


def bucket_run(url: str) -> Any:
    """The Trainer's ``checkpoint-N`` folders under ``url`` in object storage (``ckptio_checkpoint_dir``): each saved by
    :func:`save_to_bucket` as a step of ckptio's object-store protocol, read back through a checked local copy
    (:class:`~ckptio.integrations.framework_bucket.BucketRun`); ``output_dir`` keeps the logs."""
    from .framework_bucket import BucketRun

    return BucketRun(url, NAME, "Trainer's output_dir", "save_total_limit")


def trial_run(me: Any, current: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The run of one ``train`` of ``me`` whose checkpoints go to ``ckptio_checkpoint_dir`` (``current``: its run,
    or a trial's left by a ``train`` that raised; ``None``: to ``output_dir``): that run, or for a trial of
    ``hyperparameter_search`` the folder ``<url>/<run name>`` (the run name the Trainer gives the trial's local folder
    ``output_dir/<run name>``: ``run-N``, or its ``hp_name``), with its own lease, record and rotation, whose
    ``parent`` is the run. ``args``, ``kwargs``: those of ``train`` after ``resume_from_checkpoint``."""
    import os

    base = current.parent or current if current is not None else None
    trial = kwargs.get("trial", args[0] if args else None)
    if base is None or me.hp_search_backend is None or trial is None:
        return base
    name = Path(os.path.relpath(me._get_output_dir(trial=trial), me.args.output_dir)).as_posix()
    if name in ("", ".") or name.startswith("../"):
        return base
    run = bucket_run(base.location(name))
    run.parent = base
    return run


def save_to_bucket(me: Any, trial: Any, saves: Any, run: Any) -> None:
    """The Trainer's ``_save_checkpoint`` into ``run`` (in the background through ``saves`` when it is given): the
    same writers as a local save, each rank's files spooled locally and uploaded, rank 0 committing the folder."""
    from .framework_dirs import commit

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
        run.save_in_background(saves, writer, write, should, wrapped, sums)
        timer.returned()
        return
    sums.update(run.publish(writer, tmp, should))
    if wrapped is not None:
        wrapped()
    me.accelerator.wait_for_everyone()  # committed before any rank reads it
    timer.returned()
