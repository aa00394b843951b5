"""``accelerate``'s ``save_state`` / ``load_state`` through ckptio: ``CkptioAccelerator`` in place of ``Accelerator``.

The folder stays accelerate's (``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``,
``random_states_R.pkl``, ``custom_checkpoint_I.pkl`` for the objects given to ``register_for_checkpointing``), so
the plain ``Accelerator.load_state`` still reads it; ckptio adds what accelerate leaves out:

* every rank writes into one hidden folder that the main process fsyncs, describes in ``manifest.json`` (sizes
  and CRC-32C) and renames into place once all are done: no torn checkpoint under a name ``load_state`` picks;
* ``load_state()`` with automatic naming takes the newest *complete* ``checkpoint_N`` (damaged or torn ones are
  skipped with the reason; accelerate takes the highest number, whatever it holds) and sets the iteration
  counter after it, so the next ``save_state`` does not reuse a number;
* ``total_limit`` counts complete checkpoints only (those ``load_state`` would take: a torn folder is neither
  counted nor deleted, the newest complete one never deleted) and deletes hide-first, after the new one is in place
  (accelerate deletes before writing, so a crash mid-save can leave fewer checkpoints than the limit promises);
* a folder without a manifest (the plain ``Accelerator``'s) is taken only when each of its files reads whole
  through ckptio's safe readers, and every folder's RNG states are checked (accelerate skips a bad one silently);
* the registered objects' states are read with ``weights_only`` (accelerate unpickles them without restriction),
  every file through ckptio's confined reads; a file missing for a registered object is an error.
* ``CkptioAccelerator(..., async_save=True)`` saves in the background (accelerate has no such option):
  ``save_state`` copies the states into host buffers and returns; every process writes its part and the main one
  commits once all are in, then applies ``total_limit``. The next ``save_state``, ``load_state``,
  ``wait_for_save()`` and ``end_training()`` wait for it and raise its failure; a kill during the write leaves the
  previous checkpoint the newest complete one.

``CkptioAccelerator(..., ckptio_checkpoint_dir="s3://bucket/run")`` (``gs://``, ``az://``) keeps the ``checkpoint_N``
folders of ``save_state()`` / ``load_state()`` in a bucket with the same guarantees
(:mod:`ckptio.integrations.framework_bucket`); ``project_dir`` stays local.

Single process and multi-process CPU/GPU DDP are supported; FSDP, DeepSpeed and Megatron-LM write their own
sharded states and are refused.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from .errors import CheckpointCorruptError, CheckpointError, MissingDependencyError
from .storage.parse import parsing

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as _missing:  # the integration is an extra
    raise MissingDependencyError("ckptio.accelerate needs accelerate: pip install 'ckptio[accelerate]'") from _missing

from .integrations.accelerate_state import NAME as _NAME  # noqa: E402

__all__ = ["CkptioAccelerator", "usable_checkpoints", "read_random_states"]

log = logging.getLogger("ckptio")
_CUSTOM = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
_RANDOM = re.compile(r"^random_states_(\d+)\.pkl$")
_MAX_RNG = 64 << 20


class CkptioAccelerator(Accelerator):
    """An ``Accelerator`` whose ``save_state`` commits a checksummed folder and whose ``load_state`` checks it first
    and reads nothing unsafely (see the module's documentation). ``ckptio_verify``: ``"full"`` (every byte, the
    default) or ``"size"``. ``async_save``: ``save_state`` copies the states into host buffers (reused from save to
    save) and returns; the folder is written, committed and rotated in the background. The next ``save_state``,
    ``load_state``, :meth:`wait_for_save` and ``end_training`` wait for it and raise its failure.
    ``on_preemption`` (``"exit"`` or ``"return"``), ``preemption_signals``: as :class:`~ckptio.CheckpointConfig`'s;
    the loop calls :meth:`save_on_preemption` at the end of each step (docs/preemption.md).
    ``ckptio_checkpoint_dir``: ``s3://bucket/prefix`` (``gs://``, ``az://``): ``save_state()`` without a folder writes
    ``checkpoint_N`` there (``total_limit`` applied there) and ``load_state()`` takes the newest complete one there
    (or the URL of one of them), instead of ``project_dir/checkpoints``; the run's record is kept there too
    (:mod:`ckptio.integrations.framework_bucket`)."""

    def __init__(self, *args: Any, ckptio_verify: str = "full", async_save: bool = False,
                 on_preemption: str | None = None, preemption_signals: Any = ("SIGTERM",),
                 ckptio_checkpoint_dir: str | None = None, **kwargs: Any) -> None:
        from .integrations.framework_bucket import BucketRun
        from .integrations.framework_preemption import FrameworkPreemption

        self.ckptio_run = None if ckptio_checkpoint_dir is None else \
            BucketRun(ckptio_checkpoint_dir, _NAME, "project_dir", "total_limit")
        """Where ``save_state()`` and ``load_state()`` keep the checkpoints when ``ckptio_checkpoint_dir`` is given."""

        if ckptio_verify not in ("full", "size"):
            raise ValueError(f"ckptio_verify must be 'full' or 'size', not {ckptio_verify!r}")
        self.ckptio_preemption = FrameworkPreemption(on_preemption, preemption_signals, "CkptioAccelerator")
        super().__init__(*args, **kwargs)
        from .integrations.framework_async import FolderSaves
        from .integrations.framework_dirs import CheckedOnce
        from .integrations.save_numbers import SaveNumbers

        self.ckptio_verify = ckptio_verify
        self._ckptio_saves = FolderSaves("accelerate checkpoint save") if async_save else None
        self.ckptio_numbers = SaveNumbers()  # each save's numbers: to the trackers under ckpt/, and to its listeners
        self._ckptio_swept = False
        # what total_limit counts: the folders load_state would take (each read once in this run)
        self._ckptio_complete = CheckedOnce(lambda path: _check(path, ckptio_verify))
        if self.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            raise CheckpointError(f"CkptioAccelerator checkpoints single-process and DDP runs; under "
                                  f"{self.distributed_type} accelerate writes sharded states through its own code")
        self.ckptio_preemption.install()  # accelerate has no handler of its own: the script's (if any) still runs
        from .integrations.framework_audit import BackwardSteps

        self.ckptio_audit: Any = None
        """The run's record in the checkpoints' folder and its resume audit (made at the first save or load)."""
        self.ckptio_steps = BackwardSteps(None, lambda: self._optimizers[0].param_groups[0]["lr"]
                                          if self._optimizers else None)

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """``Accelerator.backward``; its ``loss`` (and the step it ends) is noted for the resume audit."""
        self.ckptio_steps.backward(loss, self.sync_gradients)
        super().backward(loss, **kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: Any, norm_type: Any = 2) -> Any:
        """``Accelerator.clip_grad_norm_``; the norm it returns is noted for the resume audit."""
        norm = super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.ckptio_steps.grad_norm(norm)
        return norm

    def _ckptio_audited(self, folder: Path) -> Any:
        """The record of the run whose checkpoints are in ``folder``, made once: in ``project_dir`` with automatic
        naming (accelerate reads every name in ``project_dir/checkpoints`` as a numbered checkpoint), else beside
        the checkpoint folders."""
        from .integrations.framework_audit import FrameworkAudit

        if self.ckptio_audit is None:
            auto = self.project_configuration.automatic_checkpoint_naming
            where = self.ckptio_run.url if self.ckptio_run is not None else \
                Path(self.project_dir) if auto and self.project_dir is not None else folder
            self.ckptio_audit = self.ckptio_steps.audit = FrameworkAudit(where)
            self.ckptio_numbers.listeners.append(self.ckptio_audit.committed)
        return self.ckptio_audit

    def save_on_preemption(self, output_dir: str | None = None, step: int | None = None) -> str | None:
        """Collective, at the end of each step, on every process: ``None`` unless a preemption signal
        (``on_preemption``) reached any process; then ``save_state(output_dir)`` committed on every process, and
        ``end_training`` and ``SystemExit(0)`` (``"exit"``), or the folder returned and ``ckptio_preempted`` set
        (``"return"``: stop the loop). ``step`` only names the step in the log."""
        signum = self.ckptio_preemption.due()
        if not signum:
            return None
        folder = self.save_state(output_dir)
        self.wait_for_save()
        self.wait_for_everyone()
        self.ckptio_preemption.saved(signum, folder if step is None else f"step {step} ({folder})")
        if self.ckptio_preemption.mode == "exit":
            from .integrations.framework_preemption import exit_after_save

            self.end_training()
            exit_after_save()
        return folder

    @property
    def ckptio_preempted(self) -> int | None:
        """The signal on which :meth:`save_on_preemption` saved for the loop to stop; ``None`` before."""
        return self.ckptio_preemption.preempted

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """``Accelerator.save_state``, written into a hidden folder by every process and committed by the main one
        (in the background with ``async_save``); returns the checkpoint's folder."""
        from .integrations.accelerate_state import committer, staged_writer
        from .storage.posix import sweep_leftovers

        self.wait_for_save()  # the previous save is committed and its staging buffers are free
        config = self.project_configuration
        auto = config.automatic_checkpoint_naming
        if self.ckptio_run is not None and output_dir is None:
            from .integrations.accelerate_state import save_state

            return save_state(self, self.ckptio_run, safe_serialization,
                              lambda out: super(CkptioAccelerator, self).save_state(out, safe_serialization, **kwargs))
        if auto:
            final = Path(self.project_dir) / "checkpoints" / f"checkpoint_{self.save_iteration}"
        elif output_dir is None:
            raise ValueError("save_state needs an output_dir when automatic checkpoint naming is off")
        else:
            final = Path(output_dir).expanduser()
        self.ckptio_steps.flush()
        self._ckptio_audited(final.parent).saved(self.ckptio_steps.step, key=config.iteration)
        timer = self.ckptio_numbers.start(step=config.iteration, folder=final)
        tmp = final.parent / f".{final.name}.tmp-{config.iteration & 0xFFFFFFFF:08x}"
        if self.is_main_process:
            if not self._ckptio_swept:
                self._ckptio_swept = True
                sweep_leftovers(final.parent)
            shutil.rmtree(tmp, ignore_errors=True)  # an earlier attempt at this iteration, killed
            tmp.mkdir(parents=True)
        self.wait_for_everyone()
        if self._ckptio_saves is not None:
            write = staged_writer(self, tmp, safe_serialization)
            config.iteration += 1
        else:
            config.automatic_checkpoint_naming = False
            try:
                super().save_state(str(tmp), safe_serialization, **kwargs)
            finally:
                config.automatic_checkpoint_naming = auto
        commit = timer.wrap(committer(self, final, tmp, auto) if self.is_main_process else None,
                            background=self._ckptio_saves is not None)
        if self._ckptio_saves is not None:
            self._ckptio_saves.start(final, write, commit)
            timer.returned()
            return str(final)
        self.wait_for_everyone()  # every process's files are in
        if commit is not None:
            commit()
        self.wait_for_everyone()  # committed before any process reads it
        self._ckptio_log()
        return str(final)

    def _ckptio_log(self) -> None:
        """The numbers of the saves committed by now, to the trackers (``Accelerator.log``) under ``ckpt/``."""
        for metrics in self.ckptio_numbers.drain():
            self.log(metrics, step=int(metrics["ckpt/step"]))

    def wait_for_save(self) -> None:
        """Block until the background save in flight (``async_save``) is committed and ``total_limit`` applied on
        every process, and the run's record is on disk with every event so far; raise the save's failure. Call it
        (or ``end_training``) before the process ends."""
        if self._ckptio_saves is not None:
            self._ckptio_saves.wait()
            self._ckptio_log()
        if self.ckptio_audit is not None:
            self.ckptio_audit.flush()

    def end_training(self) -> None:
        """``Accelerator.end_training``, once the background save in flight is committed; the signals get back the
        handlers they had before ``on_preemption``'s."""
        self.wait_for_save()
        self.ckptio_steps.flush()
        if self.ckptio_audit is not None:
            self.ckptio_audit.end()
        if self.ckptio_run is not None:
            self.ckptio_run.release()
        self.ckptio_preemption.close()
        super().end_training()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> str | None:
        """``Accelerator.load_state`` from a checked folder: ``input_dir``, or with automatic naming the newest
        complete ``checkpoint_N`` (``None`` is returned, nothing loaded, when there is none at all). The registered
        objects are read with ``weights_only``."""
        from .integrations import framework_dirs
        from .integrations.accelerate_state import load_accelerate_state
        from .formats import pt as pt_format

        if load_kwargs and load_kwargs.get("weights_only") is False:
            raise ValueError("CkptioAccelerator never loads with weights_only=False")
        self.wait_for_save()
        auto = self.project_configuration.automatic_checkpoint_naming
        run, check = self.ckptio_run, (lambda folder: _check(folder, self.ckptio_verify))
        if run is not None and (input_dir is None or run.name_of(str(input_dir))):
            fetched = run.newest(check) if input_dir is None else (None, run.resolve(str(input_dir), check))
            if fetched is None:
                log.info("ckptio: no checkpoint in %s", run.url)
                return None
            path, auto = fetched[1], True
        elif input_dir is None:
            if not auto:
                raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
            root = Path(self.project_dir) / "checkpoints"
            found = framework_dirs.newest(root, usable_checkpoints(root, verify=self.ckptio_verify))
            if found is None:
                log.info("ckptio: no checkpoint in %s/checkpoints", self.project_dir)
                return None
            path = found
        else:
            path = Path(input_dir).expanduser()
            _check(path, self.ckptio_verify)
        customs = sorted((int(m.group(1)) for p in path.iterdir() if (m := _CUSTOM.match(p.name))))
        if customs != list(range(len(self._custom_objects))):
            raise CheckpointCorruptError(f"{path}: holds the states of {len(customs)} registered object(s), this run "
                                         f"registered {len(self._custom_objects)}")
        from safetensors import SafetensorError

        with parsing(path, "(accelerate's reader)", also=(SafetensorError, OSError)):  # its errors name no file
            load_accelerate_state(self, path, load_kwargs, kwargs)
        for i, obj in enumerate(self._custom_objects):
            state = pt_format.load(path / f"custom_checkpoint_{i}.pkl")
            with parsing(path / f"custom_checkpoint_{i}.pkl", f"(loading it into {type(obj).__name__})"):
                obj.load_state_dict(state)
        if auto and (m := _NAME.match(path.name)):
            self.project_configuration.iteration = int(m.group(1)) + 1
        self._ckptio_resumed(path)
        if run is not None:
            run.drop_copies()
            return run.location(path.name)
        return str(path)

    def _ckptio_resumed(self, path: Path) -> None:
        """The step count the checkpoint at ``path`` was saved at, and the resume audit from it (a folder without a
        manifest, the plain Accelerator's, says no step: nothing to compare)."""
        from .engine.manifest import MANIFEST_NAME, read_manifest
        from .storage.confined import Folder

        folder = Folder(path)
        manifest = read_manifest(folder) if folder.kind(MANIFEST_NAME) == "file" else None
        steps = manifest.counters.get("steps") if manifest is not None else None
        if manifest is None or type(steps) is not int or steps < 0:
            return
        self.ckptio_steps.step = steps
        loaders = self._dataloaders and self.dataloader_config.use_seedable_sampler
        causes = ([] if loaders else ["dataloader"]) + ([] if self._schedulers else ["lr_scheduler"])
        self._ckptio_audited(path.parent).restored(steps, causes=causes, saved_ranks=manifest.world_size)


def usable_checkpoints(folder: str | Path, *, verify: str = "full") -> tuple[list[Path], list[tuple[str, str]]]:
    """The ``checkpoint_N`` folders in ``folder`` (``project_dir/checkpoints``) that can be loaded, newest first,
    and the others with the reason each is skipped."""
    from .integrations import framework_dirs

    return framework_dirs.usable(folder, _NAME, lambda path: _check(path, verify))


def _check(path: Path, verify: str) -> None:
    """Raise a :class:`CheckpointError` naming what is wrong unless ``path`` is a complete folder: its manifest
    matches, or (accelerate's own folder, no manifest) every file reads through ckptio's safe readers. The RNG
    states are read and checked in every folder (accelerate would skip a bad one silently)."""
    from .integrations.framework_dirs import check_manifest, read_files
    from .storage.confined import Folder

    if path.is_symlink() or not path.is_dir():
        raise CheckpointCorruptError(f"{path}: not a directory (a link is never a checkpoint)")
    folder = Folder(path)
    committed = check_manifest(folder, verify, required=False)
    if not committed and folder.kind("random_states_0.pkl") is None:
        # accelerate writes the RNG states after everything but the registered objects' states
        raise CheckpointCorruptError(f"{path}: no manifest and no random_states_0.pkl (a save cut short)")
    for entry in folder.listdir():
        if _RANDOM.match(entry.name):
            read_random_states(folder, entry.name)
    if not committed:  # nothing says its files are whole: read them (the RNG states were, above)
        read_files(folder, lambda name: name.endswith((".bin", ".pt")) or bool(_CUSTOM.match(name)))


def read_random_states(folder: Any, name: str) -> dict[str, Any]:
    """accelerate's ``random_states_R.pkl`` in ``folder`` through ckptio's restricted unpickler, each generator's
    state checked for the structure and ranges its ``set_state`` takes."""
    from .formats import safe_pickle as megatron_pickle
    from .integrations.framework_dirs import check_numpy_rng, check_python_rng, check_torch_rng
    from .storage.parse import as_int, check_depth, parsing

    where = folder.display(name)
    states, placeholders = megatron_pickle.load(folder, name, max_size=_MAX_RNG)
    with parsing(where, "as accelerate's random states"):
        if placeholders or not isinstance(states, dict) or \
                not {"random_state", "numpy_random_seed", "torch_manual_seed"} <= set(states):
            raise CheckpointCorruptError(f"{where}: not accelerate's random states (expected random_state, "
                                         "numpy_random_seed and torch_manual_seed)")
        check_depth(states, where)
        if "step" in states:
            as_int(states["step"], where, "step")
        check_python_rng(states["random_state"], where, "random_state")
        check_numpy_rng(states["numpy_random_seed"], where, "numpy_random_seed")
        check_torch_rng(states["torch_manual_seed"], where, "torch_manual_seed")
        for key in set(states) - {"step", "random_state", "numpy_random_seed", "torch_manual_seed"}:
            if key == "xm_seed":  # an XLA device's seed: an integer
                as_int(states[key], where, key)
            elif not isinstance(key, str) or not key.endswith("_manual_seed"):
                raise CheckpointCorruptError(f"{where}: an unknown entry {str(key)[:40]!r}")
            else:
                check_torch_rng(states[key], where, key, many=True)
    return states
