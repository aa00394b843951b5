"""The checkpoint manager: when to save, where, and which checkpoint a run resumes from.

Data path of a save: the manager asks the state wrappers for state dicts, hands them to the format
modules, which write into a temporary step directory; when every rank has finished, rank 0 writes the
manifest, fsyncs the tree, renames the directory into place and moves the LATEST pointer.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from . import _dist
from ._log import get_logger
from .config import VERIFY_MODES, CheckpointConfig
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ConfigError,
)
from .formats import dcp as dcp_format
from .formats import hf_bundle, peft_adapter
from .formats import pt as pt_format
from .formats import safetensors_sharded
from .formats.common import TensorInfo, full_tensors
from .formats.safetensors_sharded import check_compatible
from . import _faults, policies
from .layout import (
    LATEST,
    TMP_PREFIX,
    clean_temporaries,
    format_step_name,
    parse_step_name,
    restore_candidates,
)
from .background import BackgroundWriter
from .manifest import (
    MANIFEST_NAME,
    Manifest,
    StateEntry,
    list_files,
    model_signature,
    read_manifest,
    software_versions,
)
from .staging import Stager
from .state import ModelState, OptimizerState, RNGState
from .storage import commit_directory, fsync_tree, remove_tree, write_pointer
from .storage.checksum import bytes_checksum, file_checksum
from .storage.confined import Folder, Verifier
from .storage.lock import DirectoryLock

__all__ = ["CheckpointManager", "RestoreInfo", "Stateful"]

MODEL_DIR = "model"
CONSOLIDATED_DIR = "consolidated"
OPTIM_DIR = "optim"
_RESERVED = {MODEL_DIR, OPTIM_DIR, MANIFEST_NAME, "manifest"}


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class RestoreInfo:
    """What :meth:`CheckpointManager.restore` loaded."""

    path: Path
    step: int
    epoch: int
    metrics: dict[str, float] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)
    saved_world_size: int = 1
    name_fields: dict[str, Any] = field(default_factory=dict)
    """Fields parsed back from the directory name by the name template (the manifest wins on conflicts)."""


@dataclass
class _SaveJob:
    """One save between its snapshot (training thread) and its commit (possibly a background thread)."""

    step: int
    epoch: int
    name: str
    metrics: dict[str, float]
    counters: dict[str, Any]
    root: Path
    start: float
    consolidate: bool
    signature: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] | None = None
    peft: dict[str, torch.Tensor] | None = None
    optim: dict[str, Any] | None = None
    objects: dict[str, bytes] = field(default_factory=dict)
    sums: dict[str, str] = field(default_factory=dict)
    tmp: Path | None = None

    @property
    def final_dir(self) -> Path:
        return self.root / self.name


class CheckpointManager:
    """Saves and restores the whole training state; resumes from the newest complete checkpoint.

    Every rank constructs the manager and calls :meth:`save`, :meth:`wait`, :meth:`restore` and
    :meth:`close` at the same points (they are collectives when a process group is initialised). Not
    thread-safe: use it from the training thread. With ``config.async_save`` the writing and committing
    of a save run on a background thread of each rank, over a process group of their own (gloo), so
    they never interleave with the training loop's collectives; call :meth:`close` (or :meth:`wait`)
    before ``destroy_process_group``.

    Args:
        config: where and how to save; see :class:`CheckpointConfig`.
        model: the model (plain or FSDP2-sharded; a PEFT model when ``config.is_peft``).
        optimizer: its optimizer; saved as DCP under ``optim/``, FQN-keyed so it reshards.
        lr_scheduler: saved as the small state ``lr_scheduler.pt`` (any scheduler of ``torch.optim.lr_scheduler``).
        dataloader: any object with ``state_dict``/``load_state_dict`` (e.g. :class:`ResumableDataLoader`).
        step_scheduler: gives ``step``/``epoch`` to :meth:`save` when they are not passed.
        rng: capture the RNG streams of every rank (default on).
        extra_states: more objects with ``state_dict``/``load_state_dict``, saved under their names.
        model_key_prefix: outer prefix removed from model keys on save (``"_orig_mod."``, ``"module."``).
        tokenizer: saved with the model (``model/`` and ``model/consolidated/``) via ``save_pretrained``.
        base_model_path: PEFT only: the base model's local folder, written (absolute) into adapter_config.json.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        dataloader: Stateful | None = None,
        step_scheduler: Stateful | None = None,
        rng: bool = True,
        extra_states: dict[str, Stateful] | None = None,
        model_key_prefix: str = "",
        tokenizer: Any | None = None,
        base_model_path: str | Path | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.log = get_logger()
        self.model = model
        self.tokenizer = tokenizer
        self.base_model_path = base_model_path
        if config.is_peft and model is not None and not hasattr(model, "peft_config"):
            raise ConfigError("is_peft is true but the model is not a peft model (it has no peft_config)")
        self.model_state = ModelState(model, key_prefix=model_key_prefix, trainable_only=config.is_peft) if model else None
        if optimizer is not None and model is None:
            raise ConfigError("an optimizer needs its model: pass model= as well (optimizer state is keyed by parameter name)")
        self.optim_state = OptimizerState(model, optimizer) if optimizer is not None else None
        self.step_scheduler = step_scheduler
        self.objects: dict[str, Stateful] = {}
        if lr_scheduler is not None:
            self.register("lr_scheduler", lr_scheduler)
        if dataloader is not None:
            self.register("dataloader", dataloader)
        if step_scheduler is not None:
            self.register("step_scheduler", step_scheduler)
        if rng:
            self.register("rng", RNGState())
        for name, obj in (extra_states or {}).items():
            self.register(name, obj)
        self.restored: RestoreInfo | None = None
        self.last_saved: Path | None = None
        self._cleaned = False
        self._monitor_checked = False
        self._lock = DirectoryLock(config.checkpoint_dir)
        self._stager = Stager()
        # collective when distributed: every rank builds the manager
        self._writer = BackgroundWriter(self.log) if config.async_save and config.enabled else None

    def close(self) -> None:
        """Wait for a background save in flight (raising its error), then release the checkpoint folder.

        Also done when the manager is garbage-collected or the process exits (an error is then logged).
        """
        try:
            self.wait()
        finally:
            self._lock.release()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ registration
    def register(self, name: str, obj: Stateful) -> None:
        """Save and restore ``obj`` under ``name`` (a ``<name>.pt`` file, or ``<name>/`` per rank)."""
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"state name {name!r} must be letters, digits, '_' or '-' (it becomes a file name)")
        if name in _RESERVED:
            raise ConfigError(f"state name {name!r} is reserved; pass models and optimizers as model=/optimizer=")
        if name in self.objects:
            raise ConfigError(f"a state named {name!r} is already registered")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(f"state {name!r} ({type(obj).__name__}) needs state_dict() and load_state_dict()")
        self.objects[name] = obj

    # ------------------------------------------------------------------ save
    def save(
        self,
        *,
        step: int | None = None,
        epoch: int | None = None,
        metrics: dict[str, float] | None = None,
        counters: dict[str, Any] | None = None,
        final: bool | None = None,
    ) -> Path | None:
        """Collective: write a complete checkpoint of everything registered and commit it atomically.

        ``step``/``epoch`` default to the step scheduler's. ``final`` marks the last checkpoint of a run
        (consolidated when ``save_consolidated="final"``); by default it is the step scheduler's ``done``.

        Returns the step directory. With ``async_save`` the call returns as soon as the state is copied
        into the staging buffers, before the directory exists: it appears, complete, when the
        background write commits (:meth:`wait` blocks until then). A save in flight is waited for
        first, and an error it raised is raised here.
        """
        if not self.config.enabled:
            return None
        self.wait()
        job = self._snapshot(step, epoch, metrics, counters, final, stage=self._writer is not None)
        if self._writer is None:
            self._persist(job)
        else:
            self._writer.start(job.final_dir, lambda: self._persist(job))
        return job.final_dir

    def wait(self) -> Path | None:
        """Block until the background save in flight (if any) is committed; re-raise its error here.

        Returns the directory it committed (``None`` when nothing was in flight). Every rank should call
        it at the same point, like :meth:`save`.
        """
        return self._writer.wait() if self._writer is not None else None

    @property
    def save_in_flight(self) -> bool:
        """Whether a background save has been started and not yet waited for."""
        return self._writer is not None and self._writer.in_flight

    def _snapshot(self, step: int | None, epoch: int | None, metrics: dict[str, float] | None,
                  counters: dict[str, Any] | None, final: bool | None, *, stage: bool) -> "_SaveJob":
        """Training thread, collective: name the checkpoint and capture the state (nothing touches the disk).

        With ``stage`` the tensors are copied into the staging buffers; otherwise the job references the
        live tensors and must be persisted before training goes on.
        """
        step, epoch = self._position(step, epoch)
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        self._check_monitor(metrics)
        counters = dict(counters or {})
        root = Path(self.config.checkpoint_dir)
        name = format_step_name(self.config.name_template, step=step, epoch=epoch, metrics=metrics, counters=counters,
                                insert_field_names=self.config.auto_insert_field_names)
        rank = _dist.rank()
        start = time.perf_counter()
        if final is None:
            final = bool(getattr(self.step_scheduler, "done", False))
        job = _SaveJob(step=step, epoch=epoch, name=name, metrics=metrics, counters=counters, root=root,
                       start=start, consolidate=self.config.save_consolidated is True
                       or (self.config.save_consolidated == "final" and final))
        live: dict[str, Any] = {}
        if self.model_state is not None:
            model_sd = self.model_state.state_dict()
            job.signature = model_signature(self.model, model_sd)
            if self.config.is_peft:
                adapter = peft_adapter.adapter_name(self.model)
                weights = full_tensors(model_sd)  # collective under FSDP2
                live["peft"] = {peft_adapter.to_peft_key(k, adapter): v for k, v in weights.items()}
            else:
                live["model"] = model_sd
            del model_sd
        if self.optim_state is not None:
            live["optim"] = self.optim_state.state_dict()
        if stage:
            live = self._stager.stage(live)
        job.model, job.peft, job.optim = live.get("model"), live.get("peft"), live.get("optim")
        del live
        job.objects = _dist.run_collectively("serialising the registered states", lambda: {
            obj_name: pt_format.to_bytes(obj.state_dict(), obj_name) for obj_name, obj in self.objects.items()})
        if stage and rank == 0:
            self.log.info("Staged checkpoint %s in %.2f s (%.1f MB of staging buffers); writing it in the background",
                          name, time.perf_counter() - start, self._stager.nbytes / 1e6)
        return job

    def _check_monitor(self, metrics: dict[str, float]) -> None:
        """Refuse, at the first save that passes metrics, a ``monitor`` that is not among them.

        A misspelt monitor would rank nothing, and top-k retention would then have nothing to keep the best
        checkpoints by. (Later saves without it are allowed: a step without validation is simply unranked.)
        """
        monitor = self.config.monitor
        if monitor is None or not metrics or self._monitor_checked:
            return
        if monitor not in metrics:
            import difflib

            close = difflib.get_close_matches(monitor, list(metrics), n=1)
            raise ConfigError(
                f"monitor={monitor!r} is not among the metrics passed to save(): {sorted(metrics)}"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + " (top-k retention and the BEST pointer rank checkpoints by it; nothing was saved)"
            )
        self._monitor_checked = True

    def _persist(self, job: "_SaveJob") -> None:
        """Collective (on the current group): write the job's files, then commit them on rank 0."""
        rank, world = _dist.rank(), _dist.world_size()
        root, final_dir = job.root, job.final_dir
        if rank == 0:
            self.log.info("Saving checkpoint to %s", final_dir)

        def prepare() -> str | None:
            if rank != 0:
                return None
            root.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
            if not self._cleaned:
                self._cleaned = True
                for leftover in clean_temporaries(root):
                    self.log.info("Removed leftover of an interrupted save: %s", leftover)
            tmp = root / f"{TMP_PREFIX}{job.name}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            return str(tmp)

        tmp = job.tmp = Path(_dist.broadcast_object(_dist.run_collectively("preparing the checkpoint", prepare)))
        try:
            states = self._write_states(job, rank, world)
            _faults.point("save.states_written")
            sums: dict[str, str] = {}
            for part in _dist.all_gather_object(job.sums):
                sums.update(part)

            def commit() -> None:
                if rank != 0:
                    return
                _faults.point("commit.before_manifest")
                files = list_files(tmp)
                for rel in files:  # small side files (config, tokenizer, adapter) are summed here
                    if rel not in sums:
                        sums[rel] = file_checksum(tmp / rel)
                manifest = Manifest(
                    name=job.name, step=job.step, epoch=job.epoch, world_size=world,
                    model_save_format=self.config.model_save_format, states=states,
                    files=files, metrics=job.metrics, counters=job.counters, checksums=sums,
                    model_signature=job.signature,
                    is_peft=self.config.is_peft, versions=software_versions(),
                )
                pt_format.write_bytes(tmp / MANIFEST_NAME, manifest.to_json().encode())
                fsync_tree(tmp)
                _faults.point("commit.before_rename")
                commit_directory(tmp, final_dir)
                _faults.point("commit.before_pointer")
                write_pointer(root, LATEST, job.name)
                _faults.point("commit.before_retention")
                self._after_commit(root)

            _dist.run_collectively(f"committing {final_dir}", commit)
        except Exception:
            # An ordinary error: remove the partial save. A BaseException (KeyboardInterrupt, a process
            # being torn down) leaves the temporary for the next run's sweep, like a crash would.
            if rank == 0 and tmp.exists():
                remove_tree(tmp)
            raise
        self.last_saved = final_dir
        if rank == 0:
            self.log.info("Saved checkpoint %s in %.2f s", final_dir, time.perf_counter() - job.start)

    def _after_commit(self, root: Path) -> None:
        """Rank 0, after a commit: move BEST, then apply retention (protecting latest, best, resumed-from)."""
        restored = self.restored
        protected = {restored.path.name} if restored is not None and restored.path.parent == root else set()
        for path in policies.after_commit(root, self.config.retention_policy(), protected=protected):
            self.log.info("Removed checkpoint %s (retention)", path)

    def _consolidate(self, job: "_SaveJob", model_dir: Path, rank: int, world: int) -> None:
        out = model_dir / CONSOLIDATED_DIR
        start = time.perf_counter()
        plan, written = _dist.run_collectively(
            f"consolidating {out}",
            lambda: hf_bundle.consolidate(model_dir, out, max_shard_size=self.config.consolidated_max_shard_size,
                                          rank=rank, world_size=world),
        )
        job.sums.update({str(p.relative_to(model_dir.parent)): d for p, d in written.items()})
        if rank == 0:
            self.log.info("Consolidated %d tensors (%.1f MB) into %d file(s) under %s in %.2f s",
                          len(plan.infos), plan.total_size / 1e6, len(plan.files), out, time.perf_counter() - start)

    def _position(self, step: int | None, epoch: int | None) -> tuple[int, int]:
        sched = self.step_scheduler
        if step is None:
            step = getattr(sched, "step", None)
        if epoch is None:
            epoch = getattr(sched, "epoch", 0)
        if not isinstance(step, int) or step < 0:
            raise ConfigError("save() needs step= (a non-negative int) or a step_scheduler with a .step attribute")
        return step, int(epoch or 0)

    def _write_states(self, job: "_SaveJob", rank: int, world: int) -> dict[str, StateEntry]:
        states: dict[str, StateEntry] = {}
        tmp = job.tmp
        threads = self.config.io_threads
        if job.peft is not None:
            def write_adapter() -> None:
                if rank == 0:
                    for warning in peft_adapter.save(tmp / MODEL_DIR, self.model, job.peft,
                                                     base_model_path=self.base_model_path, tokenizer=self.tokenizer):
                        self.log.warning(warning)

            _dist.run_collectively("writing the PEFT adapter", write_adapter)
            states["model"] = StateEntry("model", "peft", MODEL_DIR)
        elif job.model is not None:
            model_sd = job.model
            if self.config.model_save_format == "safetensors":
                written = _dist.run_collectively(
                    "writing model shards",
                    lambda: safetensors_sharded.save(model_sd, tmp / MODEL_DIR, rank=rank, world_size=world,
                                                     threads=threads),
                )
                job.sums.update({str(path.relative_to(tmp)): digest for path, digest in written.items()})
                states["model"] = StateEntry("model", "safetensors", MODEL_DIR)
            else:
                written = dcp_format.save(model_sd, tmp / MODEL_DIR)
                job.sums.update({f"{MODEL_DIR}/{k}": v for k, v in written.items()})
                states["model"] = StateEntry("model", "dcp", MODEL_DIR)
            _dist.run_collectively(
                "writing the model config and tokenizer",
                lambda: hf_bundle.save_hf_extras(self.model, tmp / MODEL_DIR, self.tokenizer) if rank == 0 else None,
            )
            if job.consolidate:
                self._consolidate(job, tmp / MODEL_DIR, rank, world)
        job.model = job.peft = None
        if job.optim is not None:
            written = dcp_format.save(job.optim, tmp / OPTIM_DIR)
            job.sums.update({f"{OPTIM_DIR}/{k}": v for k, v in written.items()})
            states["optim"] = StateEntry("optimizer", "dcp", OPTIM_DIR)
            job.optim = None
        for name, data in job.objects.items():
            digests = _dist.all_gather_object(hashlib.sha256(data).hexdigest())
            per_rank = len(set(digests)) > 1

            def write(name: str = name, data: bytes = data, per_rank: bool = per_rank) -> None:
                rel = f"{name}/{_rank_file(rank)}" if per_rank else f"{name}.pt"
                if per_rank:
                    (tmp / name).mkdir(exist_ok=True)
                if per_rank or rank == 0:
                    pt_format.write_bytes(tmp / rel, data)
                    job.sums[rel] = bytes_checksum(data)

            _dist.run_collectively(f"writing {name!r}", write)
            states[name] = StateEntry("object", "pt", name if per_rank else f"{name}.pt", per_rank=per_rank)
        return states

    # ------------------------------------------------------------------ restore
    def restore(self, path: str | Path | None = None, *, verify: str | None = None) -> RestoreInfo | None:
        """Collective: load the checkpoint chosen by ``config.restore_from`` (or ``path``) into every state.

        ``verify`` (default ``config.verify``): ``"full"`` checks every byte read against the manifest's
        checksums as it is read, ``"size"`` checks that every file is present with its recorded size,
        ``"none"`` trusts the manifest.

        Returns ``None`` (and changes nothing) when ``restore_from`` is unset and there is no complete
        checkpoint yet. An explicitly requested checkpoint that does not exist, or is damaged, raises
        (:class:`CheckpointNotFoundError`, :class:`CheckpointCorruptError`). When resuming on its own
        (``restore_from`` unset or ``"LATEST"``), a checkpoint found damaged while loading is skipped with
        a warning for the next older one.
        """
        if not self.config.enabled:
            return None
        verify = self.config.verify if verify is None else verify
        if verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {list(VERIFY_MODES)}, got {verify!r}")
        self.wait()
        rank = _dist.rank()
        root = Path(self.config.checkpoint_dir)
        restore_from = str(path) if path is not None else self.config.restore_from
        automatic = restore_from in (None, LATEST)

        def find() -> list[str]:
            if rank != 0:
                return []
            return [str(p) for p in restore_candidates(root, restore_from, verify="none" if verify == "none" else "size")]

        candidates = _dist.broadcast_object(_dist.run_collectively("finding the checkpoint to restore", find))
        if not candidates:
            if rank == 0:
                self.log.info("No checkpoint found in %s; starting from scratch", root)
            return None
        for i, found in enumerate(candidates):
            try:
                return self._restore_from(Path(found), verify)
            except CheckpointError as exc:
                damaged = isinstance(exc, (CheckpointCorruptError, CheckpointNotFoundError))
                # every rank raised at the same collective; fall back only if every rank saw damage
                if not (automatic and i + 1 < len(candidates) and all(_dist.all_gather_object(damaged))):
                    raise
                if rank == 0:
                    self.log.warning("Checkpoint %s is damaged (%s); falling back to %s", found, exc, candidates[i + 1])
        raise AssertionError("unreachable")  # the last candidate returns or raises

    def _restore_from(self, step_dir: Path, verify: str) -> RestoreInfo:
        """Collective: load every state from ``step_dir`` (checked, with ``verify``, as it is read)."""
        rank = _dist.rank()
        if rank == 0:
            self.log.info("Loading checkpoint from %s", step_dir)
        start = time.perf_counter()
        manifest = _dist.run_collectively("reading the manifest", lambda: read_manifest(step_dir))
        verifier = None
        folder = Folder(step_dir)
        if verify == "full":
            verifier = Verifier(folder, manifest.checksums)
            folder = Folder(step_dir, verifier=verifier)
        objects = self._read_objects(folder, manifest)  # small and first: damage there fails fast
        self._load_model(folder, manifest)
        self._load_optimizer(folder, manifest)
        if verifier is not None:
            self._finish_verification(verifier)
        self._apply_objects(folder, objects)
        info = RestoreInfo(step_dir, manifest.step, manifest.epoch, dict(manifest.metrics),
                           dict(manifest.counters), manifest.world_size, self._name_fields(step_dir, manifest))
        for key, value in info.name_fields.items():  # e.g. a metric only the name carries
            if key not in ("step", "epoch") and key not in info.metrics and key not in info.counters:
                info.counters[key] = value
        self.restored = info
        if rank == 0:
            self.log.info(
                "Loaded checkpoint %s (step %d, epoch %d, saved on %d rank(s)%s) in %.2f s",
                step_dir, info.step, info.epoch, info.saved_world_size,
                ", every byte read checksummed" if verifier is not None else "", time.perf_counter() - start,
            )
        return info

    def _finish_verification(self, verifier: Verifier) -> None:
        """Collective: each file read during the load is completed and compared by the lowest rank that read it."""
        rank = _dist.rank()
        opened = _dist.all_gather_object(sorted(verifier.opened))
        mine = [f for f in opened[rank] if not any(f in opened[r] for r in range(rank))]
        problems = _dist.run_collectively("verifying checksums", lambda: verifier.finish(mine))
        found = [p for part in _dist.all_gather_object(problems) for p in part]
        if found:
            raise CheckpointCorruptError(f"{len(found)} file(s) do not match their checksums: " + "; ".join(found[:3]))

    def _name_fields(self, step_dir: Path, manifest: Manifest) -> dict[str, Any]:
        fields_ = parse_step_name(self.config.name_template, step_dir.name, self.config.auto_insert_field_names) or {}
        for key in ("step", "epoch"):
            if key in fields_ and fields_[key] != getattr(manifest, key) and _dist.rank() == 0:
                self.log.warning("%s: its name says %s=%s but its manifest says %s; using the manifest",
                                 step_dir, key, fields_[key], getattr(manifest, key))
        return fields_

    def _entry(self, step_dir: Path, manifest: Manifest, key: str) -> StateEntry:
        entry = manifest.states.get(key)
        if entry is None:
            raise CheckpointMismatchError(
                f"{step_dir} holds no {key!r} state (it has {sorted(manifest.states)}); "
                f"it was saved without one, so it cannot restore this run's {key}"
            )
        return entry

    def _load_model(self, step: Folder, manifest: Manifest) -> None:
        if self.model_state is None:
            return
        entry = self._entry(step.path, manifest, "model")
        target = self.model_state.state_dict()
        strict = self.config.strict and not self.config.is_peft
        self._check_signature(step.path, manifest, target)
        folder = _dist.run_collectively("opening the model folder", lambda: step.sub(entry.path))
        if entry.format == "safetensors":
            _dist.run_collectively("loading the model", lambda: safetensors_sharded.load(target, folder, strict=strict))
        elif entry.format == "peft":
            adapter = peft_adapter.adapter_name(self.model)
            _dist.run_collectively("loading the PEFT adapter", lambda: peft_adapter.load(target, folder, adapter))
        elif entry.format == "dcp":
            index = _dist.run_collectively("reading the model index", lambda: dcp_format.read_index(folder))
            check_compatible(index, target, str(folder.path), strict=strict)
            dcp_format.load(target, folder)
        else:
            raise CheckpointCorruptError(f"{step.path}: unknown model format {entry.format!r} in the manifest")
        self.model_state.load_state_dict(target)

    def _check_signature(self, step_dir: Path, manifest: Manifest, target: dict[str, torch.Tensor]) -> None:
        """Refuse a checkpoint of another model from its manifest alone, before any tensor file is read."""
        shapes = manifest.model_signature.get("shapes")
        if not isinstance(shapes, dict):
            return  # older manifests: the format-level index check below still applies
        saved = {k: TensorInfo(tuple(int(d) for d in v), "?") for k, v in shapes.items()}
        ours = model_signature(self.model, target).get("architecture")
        theirs = manifest.model_signature.get("architecture")
        where = f"{step_dir} (a checkpoint of {theirs})" if theirs and theirs != ours else str(step_dir)
        check_compatible(saved, target, where, strict=self.config.strict and not self.config.is_peft)

    def _load_optimizer(self, step: Folder, manifest: Manifest) -> None:
        if self.optim_state is None:
            return
        entry = self._entry(step.path, manifest, "optim")
        target = self.optim_state.state_dict()
        folder = _dist.run_collectively("opening the optimizer folder", lambda: step.sub(entry.path))
        index = _dist.run_collectively("reading the optimizer index", lambda: dcp_format.read_index(folder))
        flat, _ = flatten_state_dict(target)
        missing = [k for k in flat if k not in index]
        if missing:
            raise CheckpointMismatchError(
                f"{folder.path}: optimizer state does not match the live optimizer: {len(missing)} key(s) missing, "
                f"e.g. {missing[:3]} (different model, optimizer type or parameter groups?)"
            )
        tensor_target = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        check_compatible({k: index[k] for k in tensor_target}, tensor_target, str(folder.path), strict=False)
        dcp_format.load(target, folder)
        _dist.run_collectively(f"applying the optimizer state of {folder.path}",
                               lambda: _apply(self.optim_state, target, folder.path))

    def _read_objects(self, step: Folder, manifest: Manifest) -> dict[str, tuple[str, Any]]:
        """Collective: the saved state of every registered object, read and decoded but not yet applied."""
        rank, world = _dist.rank(), _dist.world_size()
        out: dict[str, tuple[str, Any]] = {}
        for name in self.objects:
            entry = manifest.states.get(name)
            if entry is None:
                if rank == 0:
                    self.log.warning("%s has no %r state; %s keeps its current state", step.path, name, name)
                continue
            rel: str | None = entry.path
            if entry.per_rank:
                rel = f"{entry.path}/{_rank_file(rank)}"
                if manifest.world_size != world:
                    if rank == 0:
                        self.log.warning(
                            "%s: %r was saved per rank on %d rank(s) and is restored on %d; each rank takes the "
                            "state saved by the same rank number, ranks beyond %d keep their own",
                            step.path, name, manifest.world_size, world, manifest.world_size,
                        )
                    if rank >= manifest.world_size:
                        rel = None

            def read_one(rel: str | None = rel) -> Any:
                return None if rel is None else pt_format.load_from(step, rel)

            # every rank takes part, even one with nothing to load, so the collectives stay matched
            value = _dist.run_collectively(f"reading {name!r}", read_one)
            if rel is not None:
                out[name] = (rel, value)
        return out

    def _apply_objects(self, step: Folder, objects: dict[str, tuple[str, Any]]) -> None:
        for name, obj in self.objects.items():
            rel, value = objects.get(name, (None, None))
            _dist.run_collectively(f"loading {name!r}",
                                   lambda obj=obj, rel=rel, value=value:
                                   None if rel is None else _apply(obj, value, step.display(rel)))


def _apply(obj: Any, state: Any, source: Path) -> None:
    """``obj.load_state_dict(state)``; a state that does not fit (a damaged or foreign file) is an error naming it."""
    try:
        obj.load_state_dict(state)
    except CheckpointError:
        raise
    except Exception as exc:  # the file decoded but holds something this object cannot take
        raise CheckpointCorruptError(
            f"{source}: the saved state does not fit {type(obj).__name__}.load_state_dict "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"
