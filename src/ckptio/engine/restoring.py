"""The restore path, top to bottom: what a :meth:`CheckpointManager.restore` does, in order.

1. **Choose** (rank 0, broadcast): the candidates from ``restore_from`` — for an auto-resume every usable
   checkpoint newest first, damaged ones skipped with a warning (:func:`ckptio.engine.layout.restore_candidates`).
2. **Read** the manifest, attach a :class:`~ckptio.storage.verify.Verifier` when every byte is to be
   checked, and read the small states first (a damaged one fails fast, before the large reads).
3. **Check and read** what changes nothing live: the manifest's model signature, the optimizer's plan, then the
   optimizer's state (DCP, resharded) into new tensors, and with ``verify: full`` the checksums of everything
   read so far (each file by the rank that hashed most of it).
4. **Load** the model through its format in the registry, into the live parameters (each rank reads only the
   bytes of its own shards), **verify** its files, then **apply** the optimizer's state and the small states.

A restore that fails changes nothing before step 4; from there it leaves the model changed and says so in its
error (a copy would double the model's memory), and what step 4 applied last is put back
(:mod:`ckptio.engine.restore_guard`). An automatic resume that falls back loads every object again; an error
at the end of the chain names what the failed attempts changed.

Damage found while loading (a corrupt or missing file, a state that does not fit) during an auto-resume
makes every rank fall back to the next candidate together; anything else is raised on every rank.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .. import _dist
from .._memory import populate_async
from .._progress import StateProgress
from ..config import VERIFY_MODES, CheckpointConfig
from ..errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError,
                      ConfigError)
from ..formats import registry
from ..formats.common import TensorInfo, check_compatible, flatten
from ..formats.registry import ShardContext
from ..adopt.foreign import restore_foreign, restore_foreign_adam
from . import shared_reads
from .partial import LoadOptions, LoadReport, load_model_partially, plan_partially, refuse
from .layout import LATEST, find_candidates, parse_step_name, step_manifest
from .manifest import Manifest, StateEntry, merge_shapes, model_signature
from .restore_guard import Apply, Kept, apply_checked, apply_state, check_model_first, entry_of, failed, groups_apply, \
    read_objects, told, verify_read
from .saving import Tracked
from ..storage import open_storage
from ..storage import reading
from ..storage.base import Storage
from ..storage.confined import Folder
from ..storage.verify import Verifier

__all__ = ["RestoreInfo", "Restorer"]


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
    report: LoadReport | None = None
    """What became of each model key (loaded, excluded, missing, unexpected, mismatched, cast)."""
    tier: str = "durable"
    """``"memory"`` when the state came from a memory tier snapshot (``path`` is then that snapshot on this node)."""


class Restorer:
    """Runs restores for one manager (collectives: every rank calls :meth:`restore` at the same point)."""

    def __init__(self, config: CheckpointConfig, tracked: Tracked, log: Any, storage: Storage, memory: Any = None) -> None:
        self.config, self.tracked, self.log, self.storage = config, tracked, log, storage
        self.memory = memory
        """The manager's :class:`~ckptio.tier.MemoryTier` (``None``: none): an automatic resume asks it first."""
        self.options = LoadOptions(config.load_states, list(config.load_exclude or []), config.strict,
                                   config.load_cast_dtype)
        self._report = LoadReport()
        self._changes: dict[str, str] = {}
        """What the failed attempts of the current restore changed in the live objects, said in its error."""

    # ---------------------------------------------------------------------------------------------- 1
    def restore(self, restore_from: str | None, verify: str | None, options: LoadOptions | None = None) -> RestoreInfo | None:
        self.options = options if options is not None else self.options
        verify = self.config.verify if verify is None else verify
        if verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {list(VERIFY_MODES)}, got {verify!r}")
        self.tracked.kept.clear()  # the state dicts kept between saves would hold the optimizer state this replaces
        self._changes = {}
        rank = _dist.rank()
        automatic = restore_from in (None, LATEST)
        foreign, candidates = find_candidates(self.storage, restore_from, verify, self.config.start_fresh_if_damaged,
                                                     self.log)
        if foreign is not None:
            return self._restore_foreign(foreign)
        if automatic and self.memory is not None:
            info = self.memory.restore(self, candidates[0] if candidates else None)
            if info is not None:
                return info
        if not candidates:
            return None
        for i, found in enumerate(candidates):
            try:
                check_model_first(self.storage, found.name, automatic and self.config.start_fresh_if_damaged)
                return self._restore_from(found, verify)
            except CheckpointError as exc:
                verdict = _after_failure(exc, automatic, candidates[i:], bool(self._changes),
                                         self.config.start_fresh_if_damaged, self.log)
                if verdict == "raise":
                    said = told(exc, list(self._changes.values()))
                    if said is exc:
                        raise
                    raise said from exc
                if verdict == "fresh":
                    return None
        raise AssertionError("unreachable")  # the last candidate returns or raises

    def _restore_foreign(self, path: Path) -> RestoreInfo:
        """Weights only, from a checkpoint of another kind (Megatron, NeMo, Hugging Face...): see :mod:`ckptio.adopt.foreign`."""
        if self.tracked.model_state is None:
            raise ConfigError(f"restore_from={str(path)!r} holds model weights only; pass model= to the manager")
        step, kind = restore_foreign(path, self.tracked.model_state, strict=self.config.strict, log=self.log)
        optimizer = self.tracked.optim_state.optimizer if self.tracked.optim_state is not None else None
        carried, scheduled = False, False
        if optimizer is not None:
            carried, scheduled = restore_foreign_adam(path, self.tracked.model_state, optimizer,
                                                      self.tracked.objects.get("lr_scheduler"), self.log)
        return RestoreInfo(path, step, 0, counters={"source_format": kind, "optimizer_restored": carried,
                                                    "scheduler_restored": scheduled}, saved_world_size=0)

    # ---------------------------------------------------------------------------------------------- 2-4
    def load(self, step_dir: Path, verify: str) -> RestoreInfo:
        """Collective: restore everything from the step directory ``step_dir`` (no choice, no fallback)."""
        return self._restore_from(step_dir, verify)

    def _restore_from(self, step_dir: Path, verify: str) -> RestoreInfo:
        if _dist.rank() == 0:
            self.log.info("Loading checkpoint from %s", step_dir)
        start = time.perf_counter()
        where = self.storage if step_dir.parent == self.storage.root else open_storage(step_dir.parent)
        where.share_step(step_dir.name)  # the listings and small files every rank reads, asked of a bucket once
        # this rank's own data files come into the page cache on a thread while the restore plans and reads
        step, live = where.folder(step_dir.name), {"model": self.tracked.model_state, "optim": self.tracked.optim_state}
        with reading.prefetch(step if isinstance(step, Folder) else None, [s for s, v in live.items()
                              if v is not None and self.options.wants(s)], _dist.rank(), _dist.world_size()):
            return self._restore_step(where, step_dir, verify, start)

    def _restore_step(self, where: Storage, step_dir: Path, verify: str, start: float) -> RestoreInfo:
        model_state = self.tracked.model_state if self.options.wants("model") else None
        target = model_state.state_dict() if model_state is not None else None
        kept = Kept(self.tracked.optim_state.optimizer if self.tracked.optim_state is not None else None)
        try:
            return self._restore_checked(where, step_dir, verify, start, target, kept)
        except Exception as exc:
            said = failed(exc, kept, self._changes, step_dir)  # what was applied put back, what was not said
            if said is exc:
                raise
            raise said from exc

    def _restore_checked(self, where: Storage, step_dir: Path, verify: str, start: float,
                         target: dict[str, Any] | None, kept: Kept) -> RestoreInfo:
        rank = _dist.rank()
        # one round: open the step, read its manifest and small states, describe the live model's keys, plan the
        # optimizer's load (its failure is told in the same round and raised after the model's checks)
        opened, shares = _dist.agree("opening the checkpoint", lambda: self._open(where, step_dir, verify, target),
                                     share=lambda o: (o.signature, _dist.report_of(o.optim_error),
                                                      o.optim_plan is not None and o.optim_plan.template is not None,
                                                      o.needs.summary() if o.needs is not None else None))
        manifest, folder = opened.manifest, opened.folder
        # the parts several ranks restore are read by one of them and sent (every rank computes the same plan)
        model_share, optim_share = shared_reads.plans([s[3] for s in shares], opened.needs, rank,
                                                      self.config.share_reads, remote=not isinstance(folder, Folder))
        if manifest.foreign is not None and rank == 0:
            self.log.warning("resuming from an AutoModel checkpoint: no manifest, sizes and checksums not verified "
                             "(%s; DCP chunk coverage and safetensors headers are still checked)", step_dir)
        self._report = LoadReport(skipped_states=[k for k in manifest.states if not self.options.wants(k)])
        checked = self._check_model(folder, manifest, target, [s[0] for s in shares]) if target is not None else False
        _dist.raise_if_any_failed("planning the optimizer load", opened.optim_error, [s[1] for s in shares])
        apply_optimizer = self._optimizer_apply(step_dir, opened, all(s[2] for s in shares), optim_share)
        done: set[str] = set()
        if opened.verifier is not None and target is not None:  # what was read so far, checked before the model
            model_dir = manifest.states["model"].path if "model" in manifest.states else ""
            verify_read(opened.verifier, done, lambda rel: not model_dir or not _under(rel, model_dir))
        if target is not None:  # read into the live parameters: from here a failure has changed the model
            self._load_model(folder, manifest, target, checked, model_share)
        apply_checked(self.tracked.objects, folder, opened, apply_optimizer, done, kept)
        self._changes = {}
        info = RestoreInfo(step_dir, manifest.step, manifest.epoch, dict(manifest.metrics),
                           dict(manifest.counters), manifest.world_size,
                           _name_fields(self.config, self.log, step_dir, manifest),
                           self._report)
        for key, value in info.name_fields.items():  # e.g. a metric only the name carries
            if key not in ("step", "epoch") and key not in info.metrics and key not in info.counters:
                info.counters[key] = value
        if rank == 0:
            self.log.info(
                "Loaded checkpoint %s (step %d, epoch %d, saved on %d rank(s)%s) in %.2f s",
                step_dir, info.step, info.epoch, info.saved_world_size,
                ", every byte read checksummed" if opened.verifier is not None else "", time.perf_counter() - start,
            )
        return info

    def _open(self, where: Storage, step_dir: Path, verify: str, target: dict[str, Any] | None) -> "_Opened":
        """This rank's part of opening a step (no collective): the manifest, a verifier when every byte is to be
        checked, the small states read and decoded (small and first: damage there fails fast), and the live
        model's shapes and dtypes against the manifest's signature, for the ranks to check together."""
        base = where.folder(step_dir.name)
        manifest = step_manifest(base)
        if manifest.foreign is not None:
            verify = "none"  # no sizes or checksums were recorded: the readers' own checks are what is left
        verifier = Verifier(base, manifest.checksums) if verify == "full" else None
        folder = where.folder(step_dir.name, verifier=verifier) if verifier is not None else base
        objects = read_objects(self, folder, manifest)
        signature = None
        if target is not None and self.options.plain and isinstance(manifest.model_signature.get("shapes"), dict):
            entry_of(step_dir, manifest, "model")
            ours = model_signature(self.tracked.model, target)
            dtypes = manifest.model_signature.get("dtypes")
            wrong = [k for k, d in ours["dtypes"].items() if isinstance(dtypes, dict) and k in dtypes and dtypes[k] != d]
            signature = (ours["shapes"], wrong[:3], ours["architecture"])
        opened = _Opened(manifest, folder, verifier, objects, signature)
        if self.options.states is not None and "optim" in self.options.states and self.tracked.optim_state is not None \
                and "optim" in manifest.pruned_groups:  # asked for by name: the hyper-parameters, no moments
            opened.groups = manifest.pruned_groups["optim"]
        elif self.options.wants("optim") and self.tracked.optim_state is not None:
            try:
                opened.optim_plan = _plan_optimizer(self.tracked.optim_state, folder, manifest)
            except Exception as exc:  # told to the other ranks with the round, raised after the model's checks
                opened.optim_error = exc
        if shared_reads.may_share(self.config.share_reads, remote=not isinstance(folder, Folder)):
            model_entry = manifest.states.get("model")
            opened.needs = shared_reads.describe_load(
                target if self.options.plain else None, model_entry.format if model_entry else None,
                opened.optim_plan.template if opened.optim_plan else None,
                opened.optim_plan.fmt if opened.optim_plan else None)
        return opened

    def _optimizer_apply(self, step_dir: Path, opened: "_Opened", fast: bool, share: Any) -> Any:
        """What hands the optimizer its state (read here into new tensors), or ``None``: nothing to restore."""
        optim_state = self.tracked.optim_state
        if opened.optim_plan is not None:
            return self._load_optimizer(step_dir, opened.optim_plan, fast, share if fast else None)
        return groups_apply(optim_state, opened.groups, step_dir, self.log)

    def _check_model(self, step: Folder, manifest: Manifest, target: dict[str, Any], signatures: list[Any]) -> bool:
        """Collective: refuse another model from the manifest's signature, before anything is read (the partial
        path plans and refuses when it loads); returns whether the signature was checked."""
        entry = entry_of(step.path, manifest, "model")
        if not self.options.plain:
            return False
        try:
            return _check_signature(step.path, manifest, signatures, self.config.strict and not self.config.is_peft)
        except CheckpointMismatchError:  # every rank raised: refuse with the report's table, key by key
            refuse(plan_partially(step, entry.path, registry.get(entry.format), target, self.options)[2], step.path)
            raise  # the manifest and the files disagree: the manifest's verdict stands

    def _load_model(self, step: Folder, manifest: Manifest, target: dict[str, Any], checked: bool,
                    share: "shared_reads.SharedReads") -> None:
        t = self.tracked
        assert t.model_state is not None
        entry = entry_of(step.path, manifest, "model")
        fmt = registry.get(entry.format)
        self._changes["model"] = (f"the model was changed (its weights were read in place from {step.path}, as a "
                                  "copy would double its memory: load a checkpoint into it again)")
        if not self.options.plain:
            self._load_model_partially(step, entry, fmt, target)
            return
        self._report.loaded = sorted(target)
        strict = self.config.strict and not self.config.is_peft
        folder = step.sub(entry.path)  # a folder that is not there fails in the format's load, on every rank
        # once the signature was checked against every rank's keys together, each rank's own read only needs
        # its keys present (a pipeline stage holds some of the model's keys)
        with StateProgress(target, f"restoring the model of {step.path.name}", self.log) as progress, \
                share.exchange(target, progress.update) as extra:  # the shared parts sent as they are read
            fmt.load_shards(target, folder, strict=strict and not checked, ctx=ShardContext(
                _dist.rank(), _dist.world_size(), progress=progress.update, extra={"model": t.model, **extra}))
        t.model_state.load_state_dict(target)

    def _load_model_partially(self, step: Folder, entry: StateEntry, fmt: Any, target: dict[str, Any]) -> None:
        """Collective: the keys that match (or are cast), the rest kept; a report, refused when ``strict``."""
        skipped = self._report.skipped_states
        self._report = load_model_partially(step, entry.path, fmt, target, self.options, self.tracked,
                                            strict=self.options.strict and not self.config.is_peft, log=self.log,
                                            progress=lambda subset: StateProgress(subset, f"restoring the model of "
                                                                              f"{step.path.name}", self.log))
        self._report.skipped_states = skipped

    def _load_optimizer(self, step_dir: Path, plan: "_OptimPlan", fast: bool,
                        share: "shared_reads.SharedReads | None") -> Any:
        """Fill the optimizer's state from the checkpoint into the planned targets (no optimizer step to initialise
        a template, no second copy of the state); ``fast``: every rank's plan covers the state, else torch's own
        path (which initialises the state first). Returns what hands the filled state to the optimizer, for
        :meth:`_finish` to run on every rank together."""
        optim_state = self.tracked.optim_state
        assert optim_state is not None
        fmt, folder, saved, template = plan
        if not fast:  # torch's path: new tensors shaped like the live state (reading into its own would change it)
            template = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
                        for k, v in optim_state.state_dict()["optim"].items()}
        assert template is not None
        missing = sorted(k for k in template if k not in saved)
        if missing:
            raise CheckpointMismatchError(f"{folder.path}: optimizer state does not match the live optimizer: "
                                          f"{len(missing)} key(s) missing, e.g. {missing[:3]} (different model, "
                                          "optimizer type or parameter groups?)")
        tensors = {k: v for k, v in template.items() if isinstance(v, torch.Tensor)}
        check_compatible({k: saved[k] for k in tensors}, tensors, str(folder.path), strict=False)
        target = {"optim": template}
        # the state is fresh memory: have its pages provided while the reads fill the tensors before them
        join = populate_async(_local(t) for t in tensors.values()) if fast else (lambda: None)
        try:
            with StateProgress(tensors, f"restoring the optimizer of {step_dir.name}", self.log) as progress, \
                    (share.exchange(flatten(target), progress.update) if share else nullcontext({})) as extra:
                fmt.load_state(target, folder, ShardContext(_dist.rank(), _dist.world_size(), progress=progress.update,
                                                            extra=extra))
        finally:
            join()
        return lambda: apply_state(Apply(optim_state) if fast else optim_state, target, folder.path)

def _name_fields(config: CheckpointConfig, log: Any, step_dir: Path, manifest: Manifest) -> dict[str, Any]:
    """The fields the name template parses back from ``step_dir``'s name (a disagreement with the manifest is
    logged)."""
    fields_ = parse_step_name(config.name_template, step_dir.name, config.auto_insert_field_names) or {}
    for key in ("step", "epoch"):
        if key in fields_ and fields_[key] != getattr(manifest, key) and _dist.rank() == 0:
            log.warning("%s: its name says %s=%s but its manifest says %s; using the manifest",
                        step_dir, key, fields_[key], getattr(manifest, key))
    return fields_


class _OptimPlan(NamedTuple):
    """This rank's plan of the optimizer's load (:func:`_plan_optimizer`)."""

    fmt: Any
    folder: Folder
    saved: dict[str, Any]
    """The checkpoint's index of the optimizer's state, keys without the ``optim.`` prefix."""
    template: dict[str, Any] | None
    """Targets for every saved entry, or ``None`` where torch's own path has to load the state."""


@dataclass
class _Opened:
    """What :meth:`Restorer._open` found on this rank."""

    manifest: Manifest
    folder: Folder
    verifier: Verifier | None
    objects: dict[str, tuple[str, Any]]
    signature: tuple[dict[str, list[int]], list[str], str | None] | None
    optim_plan: _OptimPlan | None = None
    optim_error: Exception | None = None
    groups: list[dict[str, Any]] | None = None
    """A step whose optimizer moments were pruned, its state asked for by name: the groups' hyper-parameters."""
    needs: "shared_reads.Described | None" = None
    """What this rank fills and where it runs, for sharing the reads (:func:`.shared_reads.describe_load`)."""


def _plan_optimizer(optim_state: Any, step: Folder, manifest: Manifest) -> "_OptimPlan":
    """This rank's plan of the optimizer's load (no collective): its format, its folder, the checkpoint's index
    of it, and targets allocated from that index, shaped and sharded like their parameters (``None`` when the
    state holds something that path does not cover)."""
    entry = entry_of(step.path, manifest, "optim")
    fmt = registry.get(entry.format)
    folder = step.sub(entry.path)
    saved = {k[len(OPTIM_KEY):]: v for k, v in fmt.state_index(folder).items() if k.startswith(OPTIM_KEY)}
    return _OptimPlan(fmt, folder, saved, optim_state.template(saved))


def _under(rel: str, folder: str) -> bool:
    return rel == folder.strip("/") or rel.startswith(folder.strip("/") + "/")


def _check_signature(step_dir: Path, manifest: Manifest, signatures: list[Any], strict: bool) -> bool:
    """Refuse a checkpoint of another model from its manifest alone, before any tensor file is read. The live
    model is every rank's keys together (pipeline stages hold different ones), as :meth:`Restorer._open`
    described them on each rank. Returns whether the check ran (manifests without a signature leave it to the
    format)."""
    if signatures[_dist.rank()] is None:
        return False
    shapes = manifest.model_signature["shapes"]
    saved = {k: TensorInfo(tuple(int(d) for d in v), "?") for k, v in shapes.items()}
    live = merge_shapes([s[0] for s in signatures])
    ours, theirs = signatures[_dist.rank()][2], manifest.model_signature.get("architecture")
    where = f"{step_dir} (a checkpoint of {theirs})" if theirs and theirs != ours else str(step_dir)
    check_compatible(saved, {k: TensorInfo(tuple(v), "?") for k, v in live.items()}, where, strict=strict)
    wrong = [k for s in signatures for k in s[1]]
    if wrong:  # another dtype loads only by explicit choice (cast_dtype)
        raise CheckpointMismatchError(f"{where}: dtypes differ, e.g. {wrong[:3]}")
    return True


OPTIM_KEY = "optim."


def _after_failure(exc: CheckpointError, automatic: bool, left: list[Path], changed: bool, start_fresh: bool,
                   log: Any) -> str:
    """Collective, after the candidate ``left[0]`` failed: ``"next"`` (fall back to ``left[1]``: every rank saw
    damage), ``"fresh"`` (it was the last, damaged too, nothing live was changed, and ``start_fresh_if_damaged``
    asks) or ``"raise"``; what is chosen is logged on rank 0."""
    damaged = isinstance(exc, (CheckpointCorruptError, CheckpointNotFoundError))
    seen = _dist.all_gather_object((damaged, changed)) if automatic else [(False, True)]
    if not all(d for d, _ in seen):
        return "raise"
    if len(left) > 1:
        verdict, then = "next", f"falling back to {left[1]}"
    elif start_fresh and not any(c for _, c in seen):
        verdict, then = "fresh", "no other is left: starting from scratch as start_fresh_if_damaged asks"
    else:
        return "raise"
    if _dist.rank() == 0:
        log.warning("Checkpoint %s is damaged (%s); %s", left[0], exc, then)
    return verdict


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
