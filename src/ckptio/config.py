"""Configuration of a :class:`~ckptio.CheckpointManager`, validated once at construction."""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Union

from .config_checks import parse_save_consolidated as _parse_save_consolidated
from .config_checks import validate_template as _validate_template
from .config_checks import validate_preemption, validate_retention, validate_switches, validate_tiers
from .errors import ConfigError

__all__ = ["CheckpointConfig", "MODEL_SAVE_FORMATS", "VERIFY_MODES"]

MODEL_SAVE_FORMATS = ("safetensors", "torch_save")
VERIFY_MODES = ("none", "size", "full")

SaveConsolidated = Union[bool, Literal["final", "every"]]
ModelSaveFormat = Literal["safetensors", "torch_save"]
VerifyMode = Literal["none", "size", "full"]
Mode = Literal["min", "max"]
PathLike = Union[str, Path]  # any os.PathLike works at run time



def _check_object_location(key: str, value: str, scheme: str) -> None:
    """An ``s3://``, ``gs://`` or ``az://`` (``abfs://``) location is parsed (a bucket, a plain prefix) and its client
    installed."""
    from .errors import require
    from .storage.objstore import parse_url

    try:
        parse_url(value, scheme)
    except ConfigError as exc:
        raise ConfigError(f"{key}={value!r}: {exc}") from None
    if scheme == "s3":
        require("boto3", extra="s3", purpose="checkpoints in object storage (s3://)")
    elif scheme in ("az", "abfs"):
        from .storage.azure import parse_az_url

        try:
            parse_az_url(value)
        except ConfigError as exc:
            raise ConfigError(f"{key}={value!r}: {exc}") from None
        require("azure.storage.blob", extra="azure", purpose="checkpoints in Azure Blob Storage (az://)",
                package="azure-storage-blob")
    else:
        require("google.cloud.storage", extra="gcs", purpose="checkpoints in Google Cloud Storage (gs://)",
                        package="google-cloud-storage")

@dataclass
class CheckpointConfig:
    """Where and how checkpoints are written and which one a run resumes from."""

    checkpoint_dir: PathLike = "checkpoints"
    """Folder that holds the step directories and the LATEST pointer; created on first save."""

    model_save_format: ModelSaveFormat = "safetensors"
    """``safetensors``: one safetensors file of local shards per rank; ``torch_save``: a PyTorch DCP folder."""

    optimizer_save_format: ModelSaveFormat | None = "torch_save"
    """``torch_save`` (the default, ``None`` too, whatever the model's format): a DCP folder ``optim/``, one
    ``__R_0.distcp`` per rank and ``.metadata``, as NeMo AutoModel writes and loads; ``safetensors`` (opt-in): per-rank
    shards keyed by parameter name, hyper-parameters in ``values.json``, read by ckptio only. Both reshard on load."""

    save_consolidated: SaveConsolidated = False
    """Also write a Hugging Face bundle under ``model/consolidated``: ``False``, ``True`` or ``"every"`` (every
    checkpoint) or ``"final"`` (only the last checkpoint of a run), as NeMo AutoModel 0.7 reads the same values."""

    consolidated_max_shard_size: str = "5GB"
    """Largest file of the consolidated bundle (``"5GB"``, ``"500MB"``, ``"2GiB"``); a bigger tensor gets its own file."""

    is_peft: bool = False
    """The model is a PEFT model: only the adapter weights are saved, always consolidated."""

    restore_from: PathLike | None = None
    """``None``: newest complete checkpoint in ``checkpoint_dir`` (start fresh if none); ``"LATEST"``: the LATEST pointer;
    a step directory name inside ``checkpoint_dir``; a path to a step directory, or to a folder's ``LATEST``/``BEST``."""

    start_fresh_if_damaged: bool = False
    """When an automatic resume finds step directories but none that loads (each named with its reason in a warning):
    ``False`` refuses to start (:class:`~ckptio.errors.NoUsableCheckpointError`), so a damaged folder never silently
    restarts a run from step 0; ``True`` starts from scratch with a warning. An empty folder always starts fresh."""

    name_template: str = "epoch_{epoch}_step_{step}"
    """Python format string for step directory names; must contain ``{step}``."""

    auto_insert_field_names: bool = True
    """Insert ``name=`` before a template field unless the text before it names it (NeMo, Lightning):
    ``m--{val_loss:.3f}-{step}`` gives ``m--val_loss=0.432-step=1000``; ``epoch_{epoch}_step_{step}`` stays as is."""

    save_top_k: int | None = None
    """Keep the k best by ``monitor`` (the k newest without a monitor); ``-1`` or ``None``: keep all."""

    monitor: str | None = None
    """Metric passed to ``save(metrics=…)`` that ranks checkpoints and moves the BEST pointer."""

    mode: Mode = "min"
    """``min`` or ``max``: which direction of ``monitor`` is better."""

    save_last: bool = True
    """Accepted for Lightning users: the newest checkpoint is always kept and pointed to by LATEST."""

    keep_latest: int | None = None
    """Also keep the n newest checkpoints."""

    keep_every_n_steps: int | None = None
    """Also keep every checkpoint whose step is a multiple of this (milestones)."""

    keep_newer_than_s: float | None = None
    """Also keep checkpoints younger than this many seconds."""

    keep_optimizer_latest: int | None = None
    """Keep the optimizer state in the newest n checkpoints only (older ones kept keep the rest, load weights-only and
    consolidate: docs/retention.md). ``None``: every one keeps it."""

    share_unchanged: bool = True
    """Files of frozen tensors equal (SHA-256) to the newest checkpoint's are hard-linked (in a bucket, referred to)
    instead of written again (docs/retention.md)."""

    max_recent_checkpoints: int | None = None
    """NeMo AutoModel's name for ``keep_latest`` (the newest n are kept; so are the LATEST and BEST targets)."""

    best_metric_key: str = "default"
    """NeMo AutoModel's name for ``monitor`` (with ``mode: min``); ``"default"``: unset."""

    is_async: bool | None = None
    """NeMo AutoModel's name for ``async_save``."""

    enabled: bool = True
    """``False`` turns every save and restore into a no-op (dry runs, debugging)."""

    verify: VerifyMode = "full"
    """How much of a checkpoint is checked when it is loaded: ``"full"``: every byte against the
    manifest's checksums, hashed while it is read (no second pass in the usual case); ``"size"``: every
    file is present, a regular file inside the step directory, with its recorded size; ``"none"``: the
    manifest only (readers still refuse truncated data). Damage found during an auto-resume makes it
    fall back to the previous good checkpoint, with a warning. The cost of ``full``, measured by
    ``benchmarks/verify_cost.py``, is in docs/guarantees.md."""

    strict: bool = True
    """Refuse to load a checkpoint whose model or optimizer keys differ from the live objects. ``False``
    loads the model keys that match (same name, shape and dtype), keeps the others as they are, and logs
    a table of what was missing, unexpected or mismatched (``RestoreInfo.report``)."""

    load_states: Union[list[str], None] = None
    """Which states a restore loads (``model``, ``optim``, ``lr_scheduler``, ``dataloader``, ``rng``...): ``None`` all;
    ``["model"]`` weights only (fine-tuning a pre-trained model: the rest starts fresh)."""

    load_exclude: Union[list[str], None] = None
    """Model keys a restore leaves as they are: ``fnmatch`` patterns, e.g. ``["lm_head.*"]`` for a new head."""

    load_cast_dtype: bool = False
    """Let a restore convert tensors stored in another dtype than the model's (a bfloat16 checkpoint into a
    float32 model and back); without it such a tensor is a mismatch."""

    async_save: bool = False
    """Return from ``save()`` once the state is captured; a background thread writes and commits it (one in flight;
    its error is raised at the next ``save()``, ``wait()`` or ``close()``). Edits in place before the next ``step()``:
    docs/configuration.md, "Saving in the background" (what ckptio cannot see lands in the save)."""

    failed_saves_allowed: int = 3
    """Background saves (``async_save``) and memory-tier snapshots that may fail in a row (a full disk, a bucket that
    refuses), each logged and recorded while training goes on; the next failure raises. 0: raise at the first."""

    sync_saves_may_fail: bool = False
    """A synchronous ``save()`` that fails counts against ``failed_saves_allowed`` too, instead of raising."""

    wait_for_staging: bool = False
    """With ``async_save``: ``False`` (AutoModel's default too) copies the parameters and optimizer state after
    ``save()`` returns, before the optimizer's next ``step()`` (ckptio hooks it); change them otherwise (``no_grad``,
    ``p.data``) only after ``manager.wait_for_staging()``, else the save fails or, unseen, holds the change."""

    io_threads: int | None = None
    """Threads per rank that write the model and optimizer tensors (safetensors: that many shard files per rank; DCP:
    one ``__R_0.distcp`` per rank written as that many regions). ``None``: 2 when this process has two cores of its
    own (cores over ``LOCAL_WORLD_SIZE``), else 1, as measured by ``benchmarks/save_load.py``. Reads use one thread."""

    share_reads: bool | None = None
    """On several ranks, a part several ranks restore (DDP's whole state, TP-replicated norms, HSDP replicas) is read
    once and sent to the others (:mod:`ckptio.engine.shared_reads`): bitwise the same, each stored byte read once.
    ``None``: when the job spans nodes or reads a bucket (one node's page cache already serves its ranks from one
    disk read, faster than sending: docs/benchmarks.md, "Each byte read once")."""

    memory_every_steps: int | str | None = None
    """The memory tier: every this many steps (``"auto"``: the interval that pays, see ``mtbf``),
    :meth:`~ckptio.CheckpointManager.maybe_save` takes a snapshot of the
    whole state into node-local shared memory (``memory_dir``) and copies each rank's part to ``memory_replicas``
    nodes in all, in the background; a restart resumes from the newest snapshot that survived (or the newest durable
    checkpoint, whichever is newer). ``None``: off. See docs/memory-tier.md."""

    persist_every_steps: int | str | None = None
    """With :meth:`~ckptio.CheckpointManager.maybe_save`: a durable save (to ``checkpoint_dir``) every this many
    steps. ``None``: when the step scheduler says so (``ckpt_every_steps``). ``"auto"``: the interval that loses the
    least time, from the measured cost of recent saves, the step time and ``mtbf`` (docs/goodput.md)."""

    mtbf: str | float | None = None
    """Mean time between the job's failures, for the ``"auto"`` intervals (``"6h"``, ``"30m"``, ``"2d"`` or seconds).
    ``None``: learned from the restarts in the run's record once there are some, else 24 h is assumed (logged)."""

    memory_recovers: float | None = None
    """With both tiers ``"auto"``: the share of failures the memory tier recovers from (a process or a node lost,
    not the whole job), for choosing both intervals together. ``None``: learned from the run's restores (0.9
    assumed before any)."""

    auto_min_steps: int = 1
    """The ``"auto"`` intervals are at least this many steps."""

    auto_max_steps: int | None = None
    """The ``"auto"`` intervals are at most this many steps (a checkpoint at least this often)."""

    run_record: bool = True
    """Keep the run's record (``.ckptio_record.json``: every save, restore and restart) beside the checkpoints."""

    audit_steps: int = 3
    """The resume audit (docs/goodput.md): the ``loss``, ``grad_norm``, ``lr`` given to ``maybe_save(metrics=)`` this
    many steps after each durable save are recorded, and a resumed run's compared with them. 0: off."""

    audit_tolerance: float = 0.0
    """The resume audit: the relative difference still counted as the same (non-deterministic kernels); 0: exact."""

    memory_replicas: int = 2
    """The memory tier: each rank's part is held on this many distinct nodes (its own and the rest on others, of
    distinct failure domains first: ``$CKPTIO_FAILURE_DOMAIN``); 1: no copy elsewhere. See docs/memory-tier.md."""

    memory_dir: PathLike | None = None
    """Where the memory tier keeps its snapshots on each node: a folder in a RAM-backed filesystem that outlives the
    training processes. ``None``: ``$CKPTIO_MEMORY_DIR``, else ``/dev/shm/ckptio-<uid>`` (the system's temporary
    folder where there is no ``/dev/shm``). Each run (``checkpoint_dir``) gets a private folder of its own inside."""

    on_preemption: Literal["exit", "return"] | None = None
    """Save on preemption (docs/preemption.md): on one of ``preemption_signals``, the next ``maybe_save()`` saves
    durably on every rank, at a step they agree on, then ``"exit"``: closes the manager and exits with status 0, or
    ``"return"``: sets ``CheckpointManager.preempted`` for the loop to stop. ``None`` (default): no handler."""

    preemption_signals: Union[list[str], tuple[str, ...]] = ("SIGTERM",)
    """With ``on_preemption``: the signals that mean preemption (names or numbers; the handlers they had still run)."""

    preemption_grace: str | float | None = None
    """With ``on_preemption``: the time between the signal and the kill (``"30s"``, ``"2m"``); when the run's record
    says a durable save takes longer, it is said and the memory tier's snapshot is taken first."""

    def io_thread_count(self) -> int:
        """:attr:`io_threads`, or the automatic choice when it is ``None`` (see there)."""
        return self.io_threads if self.io_threads is not None else _auto_io_threads()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every setting (and normalise paths, AutoModel's names and ``save_consolidated``); a wrong one
        raises :class:`~ckptio.errors.ConfigError` naming the key, the value and what it may be."""
        self._validate_locations()
        _validate_formats(self)
        _apply_automodel_names(self)
        validate_retention(self)
        validate_switches(self)
        validate_tiers(self)
        validate_preemption(self)
        _validate_template(self.name_template)

    def _validate_locations(self) -> None:
        fspath = lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v  # noqa: E731
        self.checkpoint_dir, self.restore_from = fspath(self.checkpoint_dir), fspath(self.restore_from)
        if not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir:
            raise ConfigError("checkpoint_dir must be a non-empty path, e.g. 'checkpoints'")
        if self.restore_from is not None and (not isinstance(self.restore_from, str) or not self.restore_from):
            raise ConfigError("restore_from must be null, 'LATEST', a step directory name, or a path")
        from .storage import url_scheme

        for key in ("checkpoint_dir", "restore_from"):
            value = getattr(self, key)
            scheme = url_scheme(value) if isinstance(value, str) else None
            if scheme in ("s3", "gs", "az", "abfs"):
                _check_object_location(key, value, scheme)
            elif scheme:
                # pathlib would read 's3://b/p' as the relative folder 's3:/b/p' and write there silently
                raise ConfigError(f"{key}={value!r}: {scheme}:// locations are not supported; give a local or "
                                  "mounted folder, or an s3://, gs:// or az:// location")
        _refuse_a_file(self.checkpoint_dir)

    def retention_policy(self):
        """The :class:`~ckptio.engine.policies.RetentionPolicy` these fields describe."""
        from .engine.policies import RetentionPolicy

        top_k = None if self.save_top_k in (None, -1) else self.save_top_k
        keep_latest = self.keep_latest
        if top_k is not None and self.monitor is None:  # Lightning: without a monitor, the k newest
            keep_latest, top_k = max(keep_latest or 0, top_k) or None, None
            if keep_latest is None:
                top_k = 0
        return RetentionPolicy(top_k=top_k, monitor=self.monitor, mode=self.mode,  # type: ignore[arg-type]
                               keep_latest=keep_latest, keep_every_n_steps=self.keep_every_n_steps,
                               keep_newer_than_s=self.keep_newer_than_s,
                               keep_optimizer_latest=self.keep_optimizer_latest)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _validate_formats(self: CheckpointConfig) -> None:
    """The formats, the consolidated bundle's shard size, ``io_threads`` and ``verify``."""
    if self.model_save_format not in MODEL_SAVE_FORMATS:
        raise ConfigError(
            f"model_save_format={self.model_save_format!r} is not supported; use one of {list(MODEL_SAVE_FORMATS)}"
        )
    if self.optimizer_save_format is not None and self.optimizer_save_format not in MODEL_SAVE_FORMATS:
        raise ConfigError(f"optimizer_save_format={self.optimizer_save_format!r} is not supported; use one of "
                          f"{list(MODEL_SAVE_FORMATS)} (null: torch_save, a DCP folder)")
    self.save_consolidated = _parse_save_consolidated(self.save_consolidated)
    from .formats.common import parse_size

    try:
        parse_size(self.consolidated_max_shard_size)
    except ConfigError as exc:
        raise ConfigError(f"consolidated_max_shard_size: {exc}") from exc
    if self.io_threads is not None and (not isinstance(self.io_threads, int) or isinstance(self.io_threads, bool)
                                        or not 1 <= self.io_threads <= 64):
        raise ConfigError(f"io_threads must be null (automatic) or an integer from 1 to 64, got "
                          f"{self.io_threads!r}")
    if self.verify not in VERIFY_MODES:
        raise ConfigError(f"verify must be one of {list(VERIFY_MODES)}, got {self.verify!r}")


def _apply_automodel_names(self: CheckpointConfig) -> None:
    """Fold NeMo AutoModel's names for three settings into ckptio's; both given and different is an error."""
    for theirs, ours, value in (("max_recent_checkpoints", "keep_latest", self.max_recent_checkpoints),
                                ("best_metric_key", "monitor",
                                 None if self.best_metric_key in (None, "default") else self.best_metric_key),
                                ("is_async", "async_save", self.is_async)):
        if value is None:
            continue
        current = getattr(self, ours)
        default = {"keep_latest": None, "monitor": None, "async_save": False}[ours]
        if current != default and current != value:
            raise ConfigError(f"{theirs}={value!r} (NeMo AutoModel's name for {ours}) contradicts {ours}={current!r}; "
                              "give one of them")
        setattr(self, ours, value)


AUTOMODEL_ONLY = {
    "model_repo_id": "the Hub id AutoModel loads base weights from; ckptio never downloads",
    "model_cache_dir": "AutoModel's Hub cache; ckptio never downloads",
    "model_state_dict_keys": "kept by AutoModel for its own backward compatibility",
    "dequantize_base_checkpoint": "AutoModel's loading of quantized base weights",
    "original_model_root_dir": "AutoModel's loading of base weights",
    "skip_task_head_prefixes_for_base_model": "AutoModel's loading of base weights",
    "v4_compatible": "AutoModel's config.json variant for transformers 4",
    "legacy_paramwrapper_layout": "AutoModel's export of fused expert LoRA weights",
    "diffusers_compatible": "AutoModel's diffusers index file name",
    "single_rank_consolidation": "ckptio consolidates on every rank in parallel",
    "staging_dir": "ckptio writes the bundle into the step directory being committed",
    "consolidation_timeout_minutes": "ckptio's consolidation is part of the save",
    "cpu_offload": "ckptio copies to host memory only for async_save",
    "allow_legacy_pickle_restore": "ckptio never unpickles arbitrary objects, trusted or not",
}
"""Keys of NeMo AutoModel's ``checkpoint:`` section that ckptio has no equivalent for, with why."""


OTHER_TOOLS_NAMES = {
    # Lightning's ModelCheckpoint (docs/migrate-lightning.md)
    "dirpath": "checkpoint_dir", "filename": "name_template (it must contain {step})",
    "auto_insert_metric_name": "auto_insert_field_names",
    "every_n_train_steps": "StepScheduler(ckpt_every_steps=N), with mgr.save() when steps.is_ckpt_step()",
    "every_n_epochs": "a mgr.save() at the end of every n-th epoch (not a CheckpointConfig field)",
    "save_weights_only": "model-only loads: mgr.restore() with only model= registered, or ckptio.load_pretrained",
    # the Hugging Face Trainer's TrainingArguments (docs/migrate-hf-trainer.md)
    "output_dir": "checkpoint_dir", "save_total_limit": "keep_latest",
    "save_steps": "StepScheduler(ckpt_every_steps=N)", "resume_from_checkpoint": "restore_from",
    "metric_for_best_model": "monitor", "greater_is_better": "mode='max' (or 'min')",
    "save_safetensors": "model_save_format='safetensors' (the default)",
}
"""Other tools' names for what a CheckpointConfig field (or another ckptio object) does, said when one is passed."""
ALIASES = frozenset({"save_last", "max_recent_checkpoints", "best_metric_key", "is_async"})
"""Fields that only take other tools' names (Lightning's, NeMo AutoModel's): accepted, not offered in messages."""


def _refuse_unknown_fields(cls: type) -> None:
    """Wrap the dataclass ``__init__`` so that a misspelt field names the closest valid one (the signature
    seen by IDEs, type checkers and configuration libraries stays the generated one)."""
    generated = cls.__dict__["__init__"]

    @functools.wraps(generated)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            if key in AUTOMODEL_ONLY:
                raise ConfigError(f"{cls.__name__}: NeMo AutoModel's {key!r} has no meaning in ckptio "
                                  f"({AUTOMODEL_ONLY[key]}); remove it (docs/migrate-automodel.md lists every key)")
            if key in OTHER_TOOLS_NAMES and key not in known:
                raise ConfigError(f"{cls.__name__} has no field {key!r}; ckptio's name for it: {OTHER_TOOLS_NAMES[key]}")
            if key not in known:
                offered = sorted(known - ALIASES)
                close = difflib.get_close_matches(key, offered, n=1)
                raise ConfigError(f"{cls.__name__} has no field {key!r}"
                                  + (f"; did you mean {close[0]!r}?" if close else f"; its fields are {offered} "
                                     "(docs/configuration.md)"))
        generated(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]


_refuse_unknown_fields(CheckpointConfig)


def _refuse_a_file(checkpoint_dir: str) -> None:
    """A local ``checkpoint_dir`` that is a file (or lies inside one) is a setting to fix, said by name, not a
    ``FileExistsError`` from the first save."""
    from .storage import url_scheme

    if url_scheme(checkpoint_dir) is not None:
        return
    found = Path(checkpoint_dir)
    for parent in (found, *found.parents):  # the folder, or the first of its parents that exists
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                where = "is" if parent == found else f"is inside {parent}, which is"
                raise ConfigError(f"checkpoint_dir={checkpoint_dir!r} {where} a file, not a folder; give the folder the "
                                  "checkpoints go in (it is created when missing), e.g. checkpoint_dir='checkpoints'")
            return


def _auto_io_threads() -> int:
    """2 when this process has two cores of its own (the cores it may run on over the node's ranks), else 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return 2 if cores // local >= 2 else 1
