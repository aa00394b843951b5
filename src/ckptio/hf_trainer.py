"""The Hugging Face ``Trainer`` checkpoints through ckptio: ``CkptioTrainer`` in place of ``Trainer``.

The layout stays the Trainer's, so everything that reads a ``checkpoint-N/`` folder still does (the plain
``Trainer`` resumes from it, ``from_pretrained`` loads its weights)::

    out/checkpoint-500/
    ├── model.safetensors, config.json, …  # save_model's output, tokenizer included: from_pretrained loads it
    ├── optimizer.pt, scheduler.pt         # plain state dicts (torch.load(weights_only=True) reads them)
    ├── rng_state.pth | rng_state_R.pth    # one per rank on several ranks
    ├── trainer_state.json, training_args.bin
    └── manifest.json                      # written last: every file's size and CRC-32C

What changes is how it gets there and how it is read back:

* **No torn checkpoint.** Every rank writes into one hidden folder (``.checkpoint-500.tmp-…``); once all are
  done, rank 0 fsyncs it, writes the manifest and renames it into place. A crash at any instant leaves either
  the whole checkpoint or none under its name; the leftovers of a killed save are swept at the next save.
* **Resume from the newest complete checkpoint.** ``train(resume_from_checkpoint=True)`` takes the newest
  ``checkpoint-N`` whose files all match its manifest (every byte checksummed unless ``verify="size"``);
  damaged or torn ones are skipped with a warning naming the reason. A folder without a manifest (written by
  the plain ``Trainer``) is taken when each of its files reads whole through ckptio's safe readers.
  When folders exist but none is usable, :class:`~ckptio.errors.NoUsableCheckpointError` is raised instead of
  silently starting over; an empty ``output_dir`` starts a fresh run (the plain ``Trainer`` raises there, which
  makes one command for the first start and every restart impossible).
* **Safe reads.** Optimizer and scheduler states load with ``weights_only``, the RNG files through ckptio's
  restricted unpickler, each opened as a regular file inside the checkpoint (no links); ``training_args.bin``
  (a full pickle) is never read. ``trainer_state.json``, ``config.json`` and the weights' index are read
  bounded (size, nesting) and every field the Trainer uses is type-checked; each RNG state is checked for what
  its ``setstate`` takes when its folder is checked, not when it is applied. A resume that lacks the optimizer or
  scheduler state is refused instead of restarting them silently.
* **Retention** follows the Trainer's own rule (``save_total_limit`` newest, the newest and the best by
  ``metric_for_best_model`` always kept) over complete checkpoints only (those a resume accepts: a torn folder is
  neither counted as kept nor deleted; the one just written and the newest complete one are never deleted), and
  deletes a checkpoint by hiding it first, so a crash never leaves half of one under its name. The Trainer's
  last deletion at the end of a run (``save_total_limit=1``: all but the best) is left out.
* **Background saves** (``async_save=True``; the Trainer has none): states copied into host buffers, then written,
  committed and rotated in the background (see :class:`CkptioTrainerMixin`).
* **Saving on preemption** (``on_preemption``; docs/preemption.md): the step a signal came in, on every rank.

``CkptioTrainer(..., ckptio_checkpoint_dir="s3://bucket/run")`` (``gs://``, ``az://``) keeps the checkpoints in a bucket
with the same guarantees (:func:`ckptio.integrations.hf_trainer_save.bucket_run`); ``output_dir`` keeps the logs.

Single process and DDP (``torchrun``) are supported. Under DeepSpeed or FSDP the Trainer writes sharded states
through its own code; ``CkptioTrainer`` refuses them at construction rather than pretend.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointCorruptError, CheckpointError, MissingDependencyError
from .integrations.hf_trainer_save import NAME as _NAME, OPTIMIZER as _OPTIMIZER, SCHEDULER as _SCHEDULER
from .integrations.hf_trainer_save import TRAINER_STATE as _TRAINER_STATE, WEIGHTS as _WEIGHTS
from .integrations.hf_trainer_save import trial_run as _trial_run
from .storage.parse import DATA_ERRORS

try:
    import accelerate  # noqa: F401  (the Trainer's own requirement, imported lazily by transformers)
    from transformers import Trainer
    from transformers.trainer_callback import TrainerState  # noqa: F401  (the Trainer's, checked here)
except ImportError as _missing:  # the integration is an extra
    raise MissingDependencyError(f"ckptio.hf_trainer needs transformers and accelerate (missing: {_missing.name}): "
                                 f"pip install 'ckptio[hf]'") from _missing

from .integrations.hf_trainer_state import side_files, trainer_state  # noqa: E402 (needs transformers, checked above)

__all__ = ["CkptioTrainerMixin", "CkptioTrainer", "usable_checkpoints", "last_checkpoint"]

log = logging.getLogger("ckptio")
_MAX_RNG = 64 << 20
_INCOMPLETE = "checkpoint-is-incomplete.txt"  # the Trainer's own marker of a save it began on SIGTERM
_RNG = re.compile(r"^rng_state(_\d+)?\.pth$")
_STATES = (_OPTIMIZER, _SCHEDULER, "scaler.pt", "pytorch_model.bin", "adapter_model.bin")  # read weights_only


class CkptioTrainerMixin:
    """Mixed in before a ``Trainer`` class (``class MyTrainer(CkptioTrainerMixin, SFTTrainer)``): its checkpoints are
    committed, checksummed ckptio folders in the Trainer's layout (see the module's documentation).

    ``ckptio_verify``: ``"full"`` (every byte checked against its checksum before a resume, the default) or
    ``"size"``. ``async_save``: copy the states into host buffers (reused from save to save) and write, commit and
    rotate in the background (:mod:`ckptio.integrations.hf_trainer_save`); the next save, ``train`` and the end of training wait
    for it and raise its failure. ``on_preemption``, ``preemption_signals``: save on preemption (docs/preemption.md).
    ``ckptio_checkpoint_dir``: ``s3://bucket/prefix`` (``gs://``, ``az://``) to keep the ``checkpoint-N`` folders
    (and the run's record) in object storage instead of ``output_dir``, which keeps the logs; a
    ``hyperparameter_search`` trial's under ``prefix/<its run name>`` (:mod:`ckptio.integrations.hf_trainer_save`).
    """

    ckptio_verify: str = "full"

    def __init__(self, *args: Any, ckptio_verify: str = "full", async_save: bool = False,
                 on_preemption: str | None = None, preemption_signals: Any = ("SIGTERM",),
                 ckptio_checkpoint_dir: str | None = None, **kwargs: Any) -> None:
        if ckptio_verify not in ("full", "size"):
            raise ValueError(f"ckptio_verify must be 'full' or 'size', not {ckptio_verify!r}")
        from .integrations.hf_trainer_save import bucket_run

        self.ckptio_run = bucket_run(ckptio_checkpoint_dir) if ckptio_checkpoint_dir is not None else None
        """Where the checkpoints are when ``ckptio_checkpoint_dir`` is given (``None``: in ``output_dir``)."""
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        from .integrations.framework_async import FolderSaves
        from .integrations.framework_dirs import CheckedOnce
        from .integrations.framework_preemption import FrameworkPreemption, trainer_callback
        from .integrations.save_numbers import SaveNumbers

        self.ckptio_preemption = FrameworkPreemption(on_preemption, preemption_signals, "CkptioTrainer")
        self.ckptio_verify = ckptio_verify
        self._ckptio_saves = FolderSaves("Trainer checkpoint save") if async_save else None
        self.ckptio_numbers = SaveNumbers()  # each save's numbers: logged under ckpt/, and to its listeners
        self._ckptio_swept = False
        self._ckptio_resuming: Path | None = None
        me: Any = self
        # what retention counts: the folders a resume would take (each read once in this run)
        self._ckptio_complete = CheckedOnce(lambda path: _check(path, ckptio_verify, me.args.save_only_model))
        if me.is_deepspeed_enabled or me.is_fsdp_enabled:
            raise CheckpointError("CkptioTrainer checkpoints single-process and DDP runs; under DeepSpeed or FSDP the "
                                  "Trainer writes sharded states through its own code (use ckptio.CheckpointManager "
                                  "in a loop of your own for FSDP2)")
        me.add_callback(trainer_callback(self.ckptio_preemption))  # at each step's end: a preemption signal?
        self.ckptio_audit: Any = None
        """The run's record in ``output_dir`` and its resume audit (rank 0; made when ``train`` starts)."""
        self._ckptio_loss: Any = None
        if self.ckptio_run is not None and me.args.push_to_hub:
            raise CheckpointError("CkptioTrainer(ckptio_checkpoint_dir=...) does not push checkpoints to the Hub "
                                  "(push_to_hub): they are in object storage, not in output_dir")
        if async_save and me.args.push_to_hub:
            raise CheckpointError("CkptioTrainer(async_save=True) does not push checkpoints to the Hub (push_to_hub): "
                                  "save synchronously to push each one")

    # ------------------------------------------------------------------------------------------- resuming
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes ckptio's newest complete checkpoint (a fresh run
        when ``output_dir`` holds none), and a named checkpoint is checked before anything is loaded."""
        me: Any = self
        self.ckptio_wait()
        run = self.ckptio_run = _trial_run(me, self.ckptio_run, args, kwargs)  # a trial's: url/<its run name>
        where = run.url if run else me.args.output_dir
        check = (lambda path: _check(path, self.ckptio_verify, me.args.save_only_model))
        if resume_from_checkpoint is True:
            found = last_checkpoint(where, verify=self.ckptio_verify) if run is None else run.newest(check)
            if found is None:
                log.info("ckptio: no checkpoint in %s, starting a fresh run", where)
            resume_from_checkpoint = None if found is None else str(found[1] if isinstance(found, tuple) else found)
        elif resume_from_checkpoint and run is not None:
            resume_from_checkpoint = str(run.resolve(str(resume_from_checkpoint), check))
        elif resume_from_checkpoint:
            _check(Path(str(resume_from_checkpoint)), self.ckptio_verify, me.args.save_only_model)
        self._ckptio_resuming = Path(resume_from_checkpoint) if resume_from_checkpoint else None
        if self.ckptio_audit is None or self.ckptio_audit.ended:  # a record object per train(): one writer at a time
            from .integrations.framework_audit import FrameworkAudit

            if self.ckptio_audit is not None:
                self.ckptio_numbers.listeners.remove(self.ckptio_audit.committed)
            self.ckptio_audit = FrameworkAudit(where)
            self.ckptio_numbers.listeners.append(self.ckptio_audit.committed)
        clean = False
        try:
            with self.ckptio_preemption.during():  # after the Trainer's own (enable_jit_checkpoint): it still runs
                out = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
                self.ckptio_wait()  # committed when train returns, whichever end-of-training hook this transformers has
                clean = True
        finally:  # a save on preemption that exits ends the process cleanly too
            self.ckptio_audit.end(clean=clean or bool(self.ckptio_preemption.preempted))
            if run is not None:
                run.release()
                self.ckptio_run = run.parent or run
        return out

    # ------------------------------------------------------------------------------------------- the resume audit
    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.training_step``; in the steps the resume audit records or compares, its loss is kept (summed
        over the micro-batches of a step)."""
        loss = super().training_step(model, inputs, *args, **kwargs)  # type: ignore[misc]
        me: Any = self
        if self.ckptio_audit is not None and self.ckptio_audit.wants(me.state.global_step + 1):
            self._ckptio_loss = loss.detach() + (0 if self._ckptio_loss is None else self._ckptio_loss)
        return loss

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, *args: Any, **kwargs: Any) -> Any:
        """The end of each step: its loss, grad norm and learning rate (what the Trainer computed) to the resume
        audit, before the Trainer logs, evaluates and saves it."""
        me: Any = self
        loss, self._ckptio_loss = self._ckptio_loss, None
        lr = kwargs.get("learning_rate", args[5] if len(args) > 5 else None)
        if loss is not None and self.ckptio_audit is not None:
            values = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
            self.ckptio_audit.tick(me.state.global_step, {k: v for k, v in values.items() if v is not None})
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)  # type: ignore[misc]

    def _load_callback_state(self) -> None:
        """``Trainer._load_callback_state`` once the arguments stored for each callback of this run are known to fit
        its class (the Trainer calls the class with them): a state that does not is an error naming the file."""
        import inspect

        me: Any = self
        if me.args.restore_callback_states_from_checkpoint:
            classes = {type(cb).__name__: type(cb) for cb in me.callback_handler.callbacks + [me.control]}
            for name, states in me.state.stateful_callbacks.items():
                for state in (states if isinstance(states, list) else [states]) if name in classes else ():
                    try:
                        inspect.signature(classes[name]).bind(**state.get("args", {}))
                    except TypeError as exc:
                        raise CheckpointCorruptError(f"{self._ckptio_resuming}/{_TRAINER_STATE}: the stored state of "
                                                     f"the callback {name} does not fit its class ({exc})") from exc
        super()._load_callback_state()  # type: ignore[misc]
        best, run = me.state.best_global_step, self.ckptio_run
        if run is not None and best and f"checkpoint-{best}" in run.committed():  # the Trainer drops a URL it resumed
            me.state.best_model_checkpoint = run.location(f"checkpoint-{best}")
        checkpoint = self._ckptio_resuming  # the Trainer resumes from it: its global step is the checkpoint's
        if self.ckptio_audit is not None and checkpoint is not None:
            rng = [p.name for p in checkpoint.iterdir() if _RNG.match(p.name)]  # one per rank saved
            name = f"rng_state_{me.args.process_index}.pth" if me.args.world_size > 1 else "rng_state.pth"
            causes = ([] if name in rng else ["rng"]) + (["dataloader"] if me.args.ignore_data_skip else []) + \
                (["lr_scheduler"] if me.args.save_only_model else [])
            self.ckptio_audit.restored(me.state.global_step, causes=causes, saved_ranks=len(rng) or None)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        from .formats import pt as pt_format
        from .state import hyper

        me: Any = self
        if checkpoint is None:
            return
        if me.args.save_only_model:
            log.warning("ckptio: save_only_model is set, the optimizer and scheduler of %s are not restored",
                        checkpoint)
            return
        optimizer = pt_format.load(Path(checkpoint) / _OPTIMIZER)
        scheduler = pt_format.load(Path(checkpoint) / _SCHEDULER)
        hyper.check(me.optimizer, optimizer, Path(checkpoint) / _OPTIMIZER)  # both before either is applied
        hyper.check(me.lr_scheduler, scheduler, Path(checkpoint) / _SCHEDULER)
        try:
            me.optimizer.load_state_dict(optimizer)
            me.lr_scheduler.load_state_dict(scheduler)
        except DATA_ERRORS as exc:  # a state of another shape, or a file re-signed after it was changed
            raise CheckpointCorruptError(f"{checkpoint}: its optimizer or scheduler state does not fit this run's "
                                         f"({type(exc).__name__}: {exc})") from exc

    def _load_rng_state(self, checkpoint: str | None) -> None:
        me: Any = self
        if checkpoint is None:
            return
        name = f"rng_state_{me.args.process_index}.pth" if me.args.world_size > 1 else "rng_state.pth"
        if not (Path(checkpoint) / name).is_file():
            log.warning("ckptio: %s has no %s (saved on another number of ranks): the random streams start anew",
                        checkpoint, name)
            return
        _apply_rng(read_rng_state(Path(checkpoint), name), me.args.parallel_mode, Path(checkpoint) / name)
        self._ckptio_say_loaded(Path(checkpoint))

    def _ckptio_say_loaded(self, checkpoint: Path) -> None:
        """The manager's line, once the Trainer has loaded everything but its data position: which checkpoint, which
        step, how it was checked."""
        me: Any = self
        if not me.is_world_process_zero():
            return
        from .engine.manifest import MANIFEST_NAME

        committed = (checkpoint / MANIFEST_NAME).is_file()
        how = (", every byte read checksummed" if self.ckptio_verify == "full" else ", sizes checked") if committed \
            else ", written by the plain Trainer: no manifest, its files read through ckptio's safe readers"
        ranks = max(1, sum(1 for p in checkpoint.iterdir() if _RNG.match(p.name)))  # one RNG file per rank saved
        log.info("Loaded checkpoint %s (step %d, epoch %.2f, saved on %d rank(s)%s)", checkpoint, me.state.global_step,
                 me.state.epoch or 0.0, ranks, how)

    def _load_best_model(self) -> None:
        me: Any = self
        self.ckptio_wait()
        best = me.state.best_model_checkpoint
        if best and self.ckptio_run is not None:  # read from a checked local copy
            check = (lambda path: _check(path, self.ckptio_verify, True))
            me.state.best_model_checkpoint = str(self.ckptio_run.resolve(best, check))
            try:
                return super()._load_best_model()  # type: ignore[misc,no-any-return]
            finally:
                me.state.best_model_checkpoint = best
                self.ckptio_run.drop_copies()
        if best:
            _check(Path(best), self.ckptio_verify, True)
        super()._load_best_model()  # type: ignore[misc]

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer._finalize_training`` without its last deletion (``save_total_limit=1``: all but the best, the newest
        complete one too): ckptio's retention ran at the last save. The background save in flight commits first."""
        me: Any = self
        self.ckptio_wait()
        limit = me.args.save_total_limit
        if limit == 1:
            me.args.save_total_limit = None
        try:
            return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]
        finally:
            me.args.save_total_limit = limit

    def _sorted_checkpoints(self, *args: Any, **kwargs: Any) -> list[str]:
        """Nothing, for the end of ``train`` in transformers without ``_finalize_training`` (5.1 to 5.x), which deletes
        what is listed here but the best (``save_total_limit=1``): as there, ckptio's retention ran at the last save
        and the save in flight commits first. ckptio's own retention is ``framework_dirs.remove_oldest``."""
        self.ckptio_wait()
        return []

    # --------------------------------------------------------------------------------------------- saving
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save, written into a hidden folder by every rank and committed by rank 0 (in the background
        with ``async_save``)."""
        from .integrations.hf_trainer_save import save_checkpoint, save_to_bucket

        if self.ckptio_audit is not None:
            self.ckptio_audit.saved(self.state.global_step)  # type: ignore[attr-defined]
        if self.ckptio_run is not None:
            save_to_bucket(self, trial, self._ckptio_saves, self.ckptio_run)
        else:
            save_checkpoint(self, trial, self._ckptio_saves, self._ckptio_complete)
        for metrics in self.ckptio_numbers.drain():  # the saves committed by now, into the Trainer's log
            self.log(metrics)  # type: ignore[attr-defined]

    def ckptio_wait(self) -> None:
        """Block until the save in flight (``async_save``) is committed and its retention done (its failure raised),
        and the run's record is on disk with every event so far; called by the next save, ``train``, the end."""
        if self._ckptio_saves is not None:
            self._ckptio_saves.wait()
            for metrics in self.ckptio_numbers.drain():
                self.log(metrics)  # type: ignore[attr-defined]
        if self.ckptio_audit is not None:
            self.ckptio_audit.flush()


class CkptioTrainer(CkptioTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are committed, checksummed ckptio folders (see
    :class:`CkptioTrainerMixin`)."""


# --------------------------------------------------------------------------------------------- the folders
def usable_checkpoints(output_dir: str | Path, *, verify: str = "full") -> tuple[list[Path], list[tuple[str, str]]]:
    """The ``checkpoint-N`` folders of ``output_dir`` a run can resume from, newest first, and the others with the
    reason each is skipped (torn, damaged, a link, an interrupted save)."""
    from .integrations import framework_dirs

    return framework_dirs.usable(output_dir, _NAME, lambda path: _check(path, verify, False))


def last_checkpoint(output_dir: str | Path, *, verify: str = "full") -> Path | None:
    """The newest complete checkpoint in ``output_dir`` (a safe ``transformers.trainer_utils.get_last_checkpoint``);
    ``None`` when there is none at all; :class:`~ckptio.errors.NoUsableCheckpointError` when there are folders but
    none is usable. Each skipped folder is logged with its reason."""
    from .integrations import framework_dirs

    return framework_dirs.newest(output_dir, usable_checkpoints(output_dir, verify=verify))


def _check(path: Path, verify: str, model_only: bool) -> None:
    """Raise a :class:`CheckpointError` naming what is wrong unless ``path`` is a complete checkpoint.

    Every folder's ``trainer_state.json`` is checked field by field and its RNG files read and checked (both are
    small); a folder without a manifest (the plain Trainer's) has its other files read through ckptio's safe
    readers too, as nothing else says they are whole."""
    from .integrations.framework_dirs import check_manifest, read_files
    from .storage.confined import Folder

    if path.is_symlink() or not path.is_dir():
        raise CheckpointCorruptError(f"{path}: not a directory (a link is never a checkpoint)")
    folder = Folder(path)
    committed = check_manifest(folder, verify, required=False)
    if not committed and folder.kind(_INCOMPLETE) is not None:
        raise CheckpointCorruptError(f"{path}: the Trainer marked this save incomplete ({_INCOMPLETE})")
    state = trainer_state(folder)
    named = _NAME.match(path.name)
    if named and int(named.group(1)) != state.global_step:  # the Trainer names each folder for its step
        raise CheckpointCorruptError(
            f"{path}: named for step {named.group(1)}, but its trainer_state.json records step {state.global_step} (a "
            f"copy of another checkpoint, or one renamed); it is neither resumed from nor counted by save_total_limit. "
            f"If it is the checkpoint of step {state.global_step}, name it checkpoint-{state.global_step}")
    if not any(folder.kind(n) == "file" for n in _WEIGHTS):
        raise CheckpointCorruptError(f"{path}: holds no model weights")
    if not model_only:
        missing = [n for n in (_OPTIMIZER, _SCHEDULER) if folder.kind(n) != "file"]
        if missing:
            raise CheckpointCorruptError(f"{path}: has no {' or '.join(missing)} (step {state.global_step}: a save "
                                         "cut short, or one made with save_only_model)")
    for entry in folder.listdir():
        if _RNG.match(entry.name):
            read_rng_state(path, entry.name)
    side_files(folder)
    if not committed:  # nothing says its files are whole: read them
        read_files(folder, lambda n: n in _STATES or n.startswith("pytorch_model-") and n.endswith(".bin"))


def read_rng_state(checkpoint: Path, name: str) -> dict[str, Any]:
    """The Trainer's ``rng_state*.pth`` through ckptio's restricted unpickler (numpy arrays and tensors only), each
    generator's state checked for the structure and ranges its ``set_state`` takes."""
    from .formats import safe_pickle as megatron_pickle
    from .integrations.framework_dirs import check_numpy_rng, check_python_rng, check_torch_rng
    from .storage.confined import Folder
    from .storage.parse import check_depth, parsing

    folder = Folder(checkpoint)
    state, placeholders = megatron_pickle.load(folder, name, max_size=_MAX_RNG)
    where = folder.display(name)
    with parsing(where, "as a Trainer RNG state"):
        if placeholders or not isinstance(state, dict) or not {"python", "numpy", "cpu"} <= set(state):
            raise CheckpointCorruptError(f"{where}: not a Trainer RNG state (expected python, numpy and cpu states)")
        check_depth(state, where)
        check_python_rng(state["python"], where, "its python state")
        check_numpy_rng(state["numpy"], where, "its numpy state")
        check_torch_rng(state["cpu"], where, "its cpu state")
        for device in set(state) - {"python", "numpy", "cpu"}:
            check_torch_rng(state[device], where, f"its {str(device)[:20]} state", many=True)
    return state


def _apply_rng(state: dict[str, Any], parallel_mode: Any, where: object) -> None:
    import numpy as np

    from .storage.parse import parsing

    with parsing(where, "its RNG state"):  # checked by read_rng_state: anything left is named, not raised bare
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np.random.set_state(state["numpy"])
        torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        from transformers.trainer_pt_utils import set_rng_state_for_device
        from transformers.training_args import ParallelMode

        set_rng_state_for_device("CUDA", torch.cuda, state, parallel_mode == ParallelMode.DISTRIBUTED)

