"""The checkpoint manager: decides when to save and what, and which checkpoint a run resumes from.

It holds the configuration and the registered states and orchestrates; the work lives elsewhere:

* :mod:`ckptio.engine.saving` — the save path, top to bottom (snapshot, write through the formats, commit);
* :mod:`ckptio.engine.restoring` — the restore path (choose, read, load through the formats, verify, fall back);
* :mod:`ckptio.engine.background` — the background writer of async saves;
* :mod:`ckptio.engine.policies` and :mod:`ckptio.engine.layout` — retention, pointers, names and discovery;
* :mod:`ckptio.formats` and :mod:`ckptio.storage` — how bytes are laid out, and where they go.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from . import _dist
from ._log import get_logger
from .engine.background import BackgroundWriter
from .config import CheckpointConfig
from .errors import ConfigError
from .formats.safetensors.peft_adapter import adapter_name
from .goodput import Goodput
from .goodput.failures import SaveFailures
from .goodput.preemption import Preemption
from .engine.layout import MODEL_DIR, OPTIM_DIR
from .engine.manifest import MANIFEST_NAME
from .engine.partial import load_options
from .engine.restoring import Restorer, RestoreInfo
from .engine.saving import Saver, Tracked
from .state import ModelState, OptimizerState, RNGState
from .state.model import uncompiled
from .storage import open_storage

__all__ = ["CheckpointManager", "RestoreInfo", "Stateful"]

_RESERVED = {MODEL_DIR, OPTIM_DIR, MANIFEST_NAME, "manifest"}


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: what the manager saves and restores."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class CheckpointManager:
    """Saves and restores the whole training state; resumes from the newest complete checkpoint.

    Every rank constructs the manager (a collective, made to train into a bucket) and calls :meth:`save`, :meth:`wait`,
    :meth:`restore` and :meth:`close` at the same points (collectives when a process group is initialised). Not
    thread-safe: use it from the training thread. With ``config.async_save`` the writing and committing of a save run on a background thread of each rank,
    over a process group of their own (gloo), so they never interleave with the training loop's collectives; call
    :meth:`close` (or :meth:`wait`) before ``destroy_process_group``. Made to train, it must be able to save (below).

    Args:
        config: where and how to save; see :class:`CheckpointConfig`.
        model: the model (plain, ``torch.compile``d: saved as the model it compiled, or FSDP2-sharded; PEFT: ``is_peft``).
        optimizer: its optimizer; saved as DCP under ``optim/``, FQN-keyed so it reshards.
        lr_scheduler: saved as the small state ``lr_scheduler.pt`` (any scheduler of ``torch.optim.lr_scheduler``).
        dataloader: any object with ``state_dict``/``load_state_dict`` (e.g. :class:`ResumableDataLoader`).
        step_scheduler: gives ``step``/``epoch`` to :meth:`save` when they are not passed.
        rng: capture the RNG streams of every rank (default on).
        extra_states: more objects with ``state_dict``/``load_state_dict``, saved under their names.
        model_key_prefix: outer prefix removed from model keys on save (``"module."``; a compiled model needs none).
        tokenizer: saved with the model (``model/`` and ``model/consolidated/``) via ``save_pretrained``.
        base_model_path: PEFT only: the base model's local folder, written (absolute) into adapter_config.json.
    """

    def __init__(self, config: CheckpointConfig, *, model: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any | None = None,
                 dataloader: Stateful | None = None, step_scheduler: Stateful | None = None, rng: bool = True,
                 extra_states: dict[str, Stateful] | None = None, model_key_prefix: str = "",
                 tokenizer: Any | None = None, base_model_path: str | Path | None = None) -> None:
        config.validate()
        self.config, self.log = config, get_logger()
        self.tracked = tracked_states(config, model, optimizer, tokenizer, base_model_path, model_key_prefix)
        self.step_scheduler = step_scheduler
        for name, obj in (("lr_scheduler", lr_scheduler), ("dataloader", dataloader),
                          ("step_scheduler", step_scheduler), ("rng", RNGState() if rng else None),
                          *(extra_states or {}).items()):
            if obj is not None:
                self.register(name, obj)
        self.restored: RestoreInfo | None = None
        self._monitor_checked = False
        self.storage = open_storage(config.checkpoint_dir)
        check_can_save(config, self.storage, trains=optimizer is not None or step_scheduler is not None)
        self._lock = self.storage.lock()
        self._saver = Saver(config, self.tracked, self.storage, self._lock, self.log)
        self._memory = memory_tier(config, self.tracked, self.log)
        self._restorer = Restorer(config, self.tracked, self.log, self.storage, self._memory)
        self._writer: BackgroundWriter | None = None  # made at the first background save
        self._goodput = Goodput(config, self.storage, step_scheduler, self.log, model, self._saver)
        self._preemption = Preemption(config, self.log)  # the handlers of on_preemption (docs/preemption.md)
        self._failures = SaveFailures(config, self.log, self._goodput.emit)  # failed_saves_allowed

    @property
    def model(self) -> nn.Module | None:
        return self.tracked.model

    @property
    def tokenizer(self) -> Any:
        """Saved with the model (``model/`` and the consolidated bundle); may be set after construction."""
        return self.tracked.tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self.tracked.tokenizer = value

    @property
    def objects(self) -> dict[str, Stateful]:
        """The registered small states, by name."""
        return self.tracked.objects

    @property
    def last_saved(self) -> Path | None:
        """The step directory of the last save committed by this manager."""
        return self._saver.last_saved

    def close(self, *, free_memory: bool | None = None) -> None:
        """Wait for a background save in flight (raising its error), release the folder, join the manager's threads and
        destroy its process groups. The memory tier's snapshots leave the node's memory when ``free_memory`` (default:
        unless an exception is propagating, so that a ``finally`` keeps them for the restart): save durably first.
        Also done when the process exits (an error is then logged; the memory tier is kept)."""
        clean = sys.exc_info()[0] is None
        free_memory = clean if free_memory is None else free_memory
        try:
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()  # waits, then destroys its group: nothing of ours alive at interpreter exit
            self.tracked.kept.clear()  # torch's state dicts kept between saves: views of the state
            if self._memory is not None:
                self._memory.close(free=free_memory)
            self._goodput.close(clean)
        finally:
            self._preemption.close()  # the signals get the handlers they had
            self._saver.close()  # the hook on the optimizer's step goes
            self._lock.release()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(free_memory=exc_type is None)

    def register(self, name: str, obj: Stateful) -> None:
        """Save and restore ``obj`` under ``name`` (a ``<name>.pt`` file, or ``<name>/`` per rank)."""
        check_state(name, obj, self.tracked.objects)
        self.tracked.objects[name] = obj

    # ------------------------------------------------------------------ save
    def save(self, *, step: int | None = None, epoch: int | None = None, metrics: dict[str, float] | None = None,
             counters: dict[str, Any] | None = None, final: bool | None = None) -> Path | None:
        """Collective: write a complete checkpoint of everything registered and commit it atomically; returns the step
        directory. ``step``/``epoch`` default to the step scheduler's; ``final`` (default: its ``done``) marks the run's
        last checkpoint. With ``async_save`` it returns once the state is captured (``wait_for_staging``); the directory
        appears when the background write commits (:meth:`wait`). A save in flight is waited for first; its failure is
        raised here beyond ``failed_saves_allowed`` in a row, else logged and recorded (``None`` for a failed sync save)."""
        if not self.config.enabled:
            return None
        start = time.perf_counter()
        self._failures.settle_all(self._memory, self._writer)
        step, epoch = position(self.step_scheduler, step, epoch)
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        if not self._monitor_checked:
            self._monitor_checked = check_monitor(self.config.monitor, metrics)
        if final is None:
            final = bool(getattr(self.step_scheduler, "done", False))
        if self.config.async_save and self._writer is None:
            self._writer = BackgroundWriter(self.log, deferred=not self.config.wait_for_staging)
        job = self._saver.snapshot(step, epoch, metrics, dict(counters or {}), final, stage=self._writer is not None)
        job.called = start
        if self._writer is None:
            if not self._failures.run(lambda: self._saver.persist(job), step):
                return None
        else:
            job.blocked_s, self._failures.steps["durable"] = time.perf_counter() - start, step
            self._writer.start(job.final_dir, lambda: self._saver.persist(job))
        self._goodput.saved("durable", step, time.perf_counter() - start)
        return job.final_dir

    def wait(self) -> Path | None:
        """Collective: block until the save in flight (and a memory snapshot's, the run's record) is committed; re-raise
        its error here. Returns the directory it committed (``None`` when nothing was in flight)."""
        if self._memory is not None:
            self._memory.wait()
        self._goodput.flush()  # the record's thread's write and the snapshots' events held back: on disk
        return self._writer.wait() if self._writer is not None else None

    def wait_for_staging(self) -> None:
        """Block until the save in flight copied the parameters and optimizer state (before changing them other than by
        ``step()``, which waits by itself: ``CheckpointConfig.wait_for_staging``)."""
        for saver in [self._saver] + ([self._memory.saver] if self._memory is not None else []):
            saver.stager.finish()  # made here, or waited for while the writer's thread makes them

    def save_memory(self, *, step: int | None = None, epoch: int | None = None,
                    counters: dict[str, Any] | None = None) -> Path | None:
        """Collective: a snapshot of everything into the memory tier (``memory_every_steps`` must be set). Returns
        once the state is staged (the pause) with where it will be on this node; it is written, replicated on the
        next node and committed in the background (skipped, with a warning, when a node has no room for it)."""
        if not self.config.enabled:
            return None
        if self._memory is None:
            raise ConfigError("save_memory() needs the memory tier: set memory_every_steps in the CheckpointConfig")
        start = time.perf_counter()
        self._failures.settle_all(self._memory, None)
        step, epoch = position(self.step_scheduler, step, epoch)
        base = self._saver.last_step if self._saver.last_step is not None else self._memory.durable_step
        where = self._memory.save(step, epoch, dict(counters or {}), base)
        self._failures.steps["memory"] = step
        self._goodput.saved("memory", step, time.perf_counter() - start)
        return where

    def maybe_save(self, *, step: int | None = None, epoch: int | None = None, metrics: dict[str, float] | None = None,
                   counters: dict[str, Any] | None = None) -> Path | None:
        """Collective; call after every training step. Saves durably when one is due (every ``persist_every_steps``
        steps, or when the step scheduler says so, and at the last step), else takes a memory snapshot when one is
        due (every ``memory_every_steps`` steps). Returns what :meth:`save` or :meth:`save_memory` returned, or
        ``None`` when nothing was due. After a preemption signal (``on_preemption``): see :attr:`preempted`."""
        step, epoch = position(self.step_scheduler, step, epoch)
        self._goodput.tick(step, metrics)  # metrics: the resume audit's
        if self._preemption.agreed():  # a signal on any rank: save, then exit or hand back (docs/preemption.md)
            return self._preemption.stop(self, step, epoch, metrics, counters)
        due = what_is_due(self.config, self.step_scheduler, step, self._goodput)
        if due == "durable":
            return self.save(step=step, epoch=epoch, metrics=metrics, counters=counters)
        return self.save_memory(step=step, epoch=epoch, counters=counters) if due == "memory" else None

    def add_listener(self, listener: Any) -> None:
        """Call ``listener(event)`` with each event of the run's record made on this rank (docs/goodput.md)."""
        self._goodput.listeners.append(listener)

    def preemption_pending(self) -> bool:
        """Collective: whether a preemption signal reached any rank, so that the next :meth:`maybe_save` saves and
        stops (a loop that computes its ``monitor`` metric only now and then computes it first)."""
        return bool(self._preemption.agreed())

    @property
    def preempted(self) -> int | None:
        """The signal (``on_preemption``) on which :meth:`maybe_save` saved for the loop to stop; ``None`` before."""
        return self._preemption.preempted

    @property
    def memory_tier(self) -> Any:
        """The memory tier (``None`` without it); ``.last`` holds the figures of its last snapshot."""
        return self._memory

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the staging buffers of background saves (allocated once, reused)."""
        return self._saver.stager.nbytes

    @property
    def save_in_flight(self) -> bool:
        """Whether a background save has been started and not yet waited for."""
        return self._writer is not None and self._writer.in_flight

    # ------------------------------------------------------------------ restore
    def restore(self, path: str | Path | None = None, *, verify: str | None = None, states: list[str] | None = None,
                exclude: list[str] | None = None, strict: bool | None = None,
                cast_dtype: bool | None = None) -> RestoreInfo | None:
        """Collective: load the checkpoint chosen by ``config.restore_from`` (or ``path``) into every state.

        ``verify`` (default ``config.verify``): ``"full"`` checks every byte read against the manifest's
        checksums as it is read, ``"size"`` checks that every file is present with its recorded size,
        ``"none"`` trusts the manifest. ``path`` may also be a checkpoint ckptio did not write (a Megatron-LM
        or Megatron-Core run folder, a ``.nemo``, a Hugging Face folder...): its weights are loaded into the
        model, on any layout, and the rest starts fresh (:mod:`ckptio.adopt.foreign`).

        Partial loads (each defaults to the config's ``load_states``, ``load_exclude``, ``strict``,
        ``load_cast_dtype``): ``states`` which states to load (``["model"]``: weights only); ``exclude``
        model keys to leave as they are (``fnmatch`` patterns); ``strict=False`` loads the model keys that
        match and keeps the rest; ``cast_dtype`` converts tensors stored in another dtype. What became of
        each key is ``RestoreInfo.report`` (logged as a table when not everything matched); with
        ``strict`` a mismatch raises :class:`CheckpointMismatchError` carrying the same table.

        Returns ``None`` (and changes nothing) when ``restore_from`` is unset and there is no complete
        checkpoint yet. An explicitly requested checkpoint that does not exist, or is damaged, raises
        (:class:`CheckpointNotFoundError`, :class:`CheckpointCorruptError`). When resuming on its own
        (``restore_from`` unset or ``"LATEST"``), a checkpoint found damaged while loading is skipped with
        a warning for the next older one.
        """
        if not self.config.enabled:
            return None
        self.wait()
        options = load_options(self.config, ["model", "optim", *self.tracked.objects], states=states, exclude=exclude,
                               strict=strict, cast_dtype=cast_dtype)
        target, start = path if path is not None else self.config.restore_from, time.perf_counter()
        with self.storage.session():  # the folder and the step are listed once, the manifest read once
            info = self._restorer.restore(None if target is None else os.fspath(target), verify, options)
            if info is not None:
                self._goodput.restored(info, time.perf_counter() - start)
                self.restored = info
                if info.path.parent == self.storage.root:
                    self._saver.protected = {info.path.name}  # retention keeps what this run resumed from
        return info


def tracked_states(config: CheckpointConfig, model: nn.Module | None, optimizer: torch.optim.Optimizer | None,
                   tokenizer: Any, base_model_path: str | Path | None, model_key_prefix: str) -> Tracked:
    """What a manager saves of the model and optimizer (refusing a PEFT config without a PEFT model, an optimizer
    without its model)."""
    model = uncompiled(model) if model is not None else None  # torch.compile's wrapper: the same parameters
    if config.is_peft and model is not None and not hasattr(model, "peft_config"):
        raise ConfigError("is_peft is true but the model is not a peft model (it has no peft_config)")
    if optimizer is not None and model is None:
        raise ConfigError("an optimizer needs its model: pass model= as well (optimizer state is keyed by parameter "
                          "name)")
    return Tracked(
        model=model, tokenizer=tokenizer, base_model_path=base_model_path,
        model_state=ModelState(model, key_prefix=model_key_prefix, trainable_only=config.is_peft)
        if model is not None else None,
        optim_state=OptimizerState(model, optimizer, peft_adapter=adapter_name(model) if config.is_peft else None)
        if optimizer is not None and model is not None else None,
    )


def check_can_save(config: CheckpointConfig, storage: Any, *, trains: bool) -> None:
    """For :class:`CheckpointManager`: a manager given an optimizer or a step scheduler is made to train, and so to save: a ``checkpoint_dir`` it could
    not save into (read-only, a bucket that does not exist) is refused when it is made, before any training, not at
    its first save. One given only what it loads may read from a read-only folder.

    A bucket is one for every rank: on several ranks rank 0 alone asks it, and tells the others (one broadcast, against
    a request of several ms of CPU on GCS's and Azure's clients); its refusal is raised on every rank. A local folder
    may be each node's own disk: every rank checks its own."""
    if config.enabled and trains:
        if getattr(storage, "same_on_every_rank", False) and _dist.world_size() > 1:
            _dist.decide_on_rank0(f"checking {storage.root}", storage.check_writable)
        else:
            storage.check_writable()


def memory_tier(config: CheckpointConfig, tracked: Tracked, log: Any) -> Any:
    """The memory tier when ``memory_every_steps`` is set, else ``None``."""
    if config.memory_every_steps is None:
        return None
    from .tier import MemoryTier

    return MemoryTier(config, tracked, log)


def position(sched: Any, step: int | None, epoch: int | None) -> tuple[int, int]:
    """``step`` and ``epoch``, from the step scheduler where not given."""
    if step is None:
        step = getattr(sched, "step", None)
    if epoch is None:
        epoch = getattr(sched, "epoch", 0)
    if not isinstance(step, int) or step < 0:
        raise ConfigError("save() needs step= (a non-negative int) or a step_scheduler with a .step attribute")
    return step, int(epoch or 0)


def what_is_due(config: CheckpointConfig, sched: Any, step: int, goodput: Any = None) -> str | None:
    """For :meth:`CheckpointManager.maybe_save`: ``"durable"`` every ``persist_every_steps`` steps (without it, when
    the step scheduler says so; ``"auto"``: when ``goodput``'s planner says so) and at the last step, else
    ``"memory"`` every ``memory_every_steps``, else ``None``."""
    auto = {tier: goodput.due(tier, step) if goodput is not None else None for tier in ("durable", "memory")}
    every = config.persist_every_steps
    is_due = getattr(sched, "is_ckpt_step", None)
    if auto["durable"] is not None:
        durable = auto["durable"]
    else:
        durable = step % every == 0 if isinstance(every, int) else bool(is_due()) if callable(is_due) else False
    if durable or getattr(sched, "done", False):
        return "durable"
    mem = config.memory_every_steps
    memory = auto["memory"] if auto["memory"] is not None else isinstance(mem, int) and step % mem == 0
    return "memory" if memory else None


def check_monitor(monitor: str | None, metrics: dict[str, float]) -> bool:
    """Refuse a ``monitor`` that is not among the ``metrics`` of a run's first save; returns whether it was checked.

    A misspelt monitor, or none passed at all, would rank nothing, and top-k retention would then keep every
    checkpoint and ``BEST`` would never be written (Lightning refuses the same). Later saves without it are allowed:
    a step without validation is simply unranked.
    """
    if monitor is None:
        return False
    if not metrics:
        raise ConfigError(
            f"monitor={monitor!r} is set, but the first save() was passed no metrics: top-k retention and the BEST "
            f"pointer rank checkpoints by it, so nothing would ever be ranked or deleted. Pass it, as "
            f"save(metrics={{{monitor!r}: value}}), at least at the first save (later saves without it are kept "
            "unranked), or unset monitor and save_top_k. Nothing was saved.")
    if monitor not in metrics:
        import difflib

        close = difflib.get_close_matches(monitor, list(metrics), n=1)
        raise ConfigError(
            f"monitor={monitor!r} is not among the metrics passed to save(): {sorted(metrics)}"
            + (f"; did you mean {close[0]!r}?" if close else "")
            + " (top-k retention and the BEST pointer rank checkpoints by it; nothing was saved)"
        )
    return True


def check_state(name: str, obj: Any, registered: dict[str, Any]) -> None:
    """Refuse a state :meth:`CheckpointManager.register` cannot keep, naming why."""
    if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"state name {name!r} must be letters, digits, '_' or '-' (it becomes a file name)")
    if name in _RESERVED:
        raise ConfigError(f"state name {name!r} is reserved; pass models and optimizers as model=/optimizer=")
    if name in registered:
        raise ConfigError(f"a state named {name!r} is already registered")
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        hint = ""
        if isinstance(obj, torch.utils.data.DataLoader):
            hint = (": a plain DataLoader cannot say where it is, so a resumed run would repeat data; use "
                    "ckptio.ResumableDataLoader or torchdata's StatefulDataLoader")
        raise ConfigError(f"state {name!r} ({type(obj).__name__}) needs state_dict() and load_state_dict(){hint}")

