"""The restore path, top to bottom: what a :meth:`CheckpointManager.restore` does, in order.

1. **Choose** (rank 0, broadcast): the candidates from ``restore_from`` — for an auto-resume every usable
   checkpoint newest first, damaged ones skipped with a warning (:func:`ckptio.engine.layout.restore_candidates`).
2. **Read** the manifest, attach a :class:`~ckptio.storage.verify.Verifier` when every byte is to be
   checked, and read the small states first (a damaged one fails fast, before the large reads).
3. **Load** the model through its format in the registry (each rank reads only the bytes of its own
   shards) after checking the manifest's model signature, then the optimizer (DCP, resharded).
4. **Apply** the optimizer's state and the small states, then **verify** the checksums of every file read
   (each file by the rank that hashed most of it). A restore that fails after its first load leaves the live
   objects partly changed; an automatic resume then falls back and loads every one of them again.

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
from ..formats import pt as pt_format
from ..formats import registry
from ..formats.common import TensorInfo, check_compatible, flatten
from ..formats.registry import ShardContext
from ..adopt.foreign import restore_foreign, restore_foreign_adam
from . import shared_reads
from .partial import LoadOptions, LoadReport, load_model_partially, plan_partially, refuse
from .layout import LATEST, find_candidates, parse_step_name, step_manifest
from .manifest import Manifest, StateEntry, merge_shapes, model_signature
from .saving import Tracked
from ..storage import open_storage
from ..storage import reading
from ..storage.base import Storage
from ..storage.confined import Folder
from ..storage.verify import Verifier, finishers

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

    # ---------------------------------------------------------------------------------------------- 1
    def restore(self, restore_from: str | None, verify: str | None, options: LoadOptions | None = None) -> RestoreInfo | None:
        self.options = options if options is not None else self.options
        verify = self.config.verify if verify is None else verify
        if verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {list(VERIFY_MODES)}, got {verify!r}")
        self.tracked.kept.clear()  # the state dicts kept between saves would hold the optimizer state this replaces
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
                return self._restore_from(found, verify)
            except CheckpointError as exc:
                damaged = isinstance(exc, (CheckpointCorruptError, CheckpointNotFoundError))
                # every rank raised at the same collective; fall back only if every rank saw damage
                if not (automatic and i + 1 < len(candidates) and all(_dist.all_gather_object(damaged))):
                    raise
                if rank == 0:
                    self.log.warning("Checkpoint %s is damaged (%s); falling back to %s", found, exc, candidates[i + 1])
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
        # this rank's own data files come into the page cache on a thread while the restore plans and reads
        step = where.folder(step_dir.name)
        live = {"model": self.tracked.model_state, "optim": self.tracked.optim_state}
        with reading.prefetch(step if isinstance(step, Folder) else None, [s for s, v in live.items()
                              if v is not None and self.options.wants(s)], _dist.rank(), _dist.world_size()):
            return self._restore_step(where, step_dir, verify, start)

    def _restore_step(self, where: Storage, step_dir: Path, verify: str, start: float) -> RestoreInfo:
        rank = _dist.rank()
        model_state = self.tracked.model_state if self.options.wants("model") else None
        target = model_state.state_dict() if model_state is not None else None
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
        if target is not None:
            self._load_model(folder, manifest, target, [s[0] for s in shares], model_share)
        _dist.raise_if_any_failed("planning the optimizer load", opened.optim_error, [s[1] for s in shares])
        apply_optimizer = None
        if opened.optim_plan is not None:
            fast = all(s[2] for s in shares)
            apply_optimizer = self._load_optimizer(step_dir, opened.optim_plan, fast, optim_share if fast else None)
        self._finish(folder, opened, apply_optimizer)
        info = RestoreInfo(step_dir, manifest.step, manifest.epoch, dict(manifest.metrics),
                           dict(manifest.counters), manifest.world_size, self._name_fields(step_dir, manifest),
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
        objects = _read_objects(self, folder, manifest)
        signature = None
        if target is not None and self.options.plain and isinstance(manifest.model_signature.get("shapes"), dict):
            _entry(step_dir, manifest, "model")
            ours = model_signature(self.tracked.model, target)
            dtypes = manifest.model_signature.get("dtypes")
            wrong = [k for k, d in ours["dtypes"].items() if isinstance(dtypes, dict) and k in dtypes and dtypes[k] != d]
            signature = (ours["shapes"], wrong[:3], ours["architecture"])
        opened = _Opened(manifest, folder, verifier, objects, signature)
        if self.options.wants("optim") and self.tracked.optim_state is not None:
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

    def _finish(self, step: Folder, opened: "_Opened", apply_optimizer: Any) -> None:
        """Collective, two rounds: hand the optimizer and every registered object what was read for them (the
        verifier's hashed ranges travel with this round), then have each file read completed and compared by the
        rank that hashed most of it (the lowest, on a tie): a file every rank opened for its header is read once."""
        verifier = opened.verifier

        def apply() -> None:
            if apply_optimizer is not None:
                apply_optimizer()
            for name, (rel, value) in opened.objects.items():
                apply_state(self.tracked.objects[name], value, step.display(rel))

        if verifier is None and apply_optimizer is None and not self.tracked.objects:
            return
        _, hashed = _dist.agree("applying the loaded state", apply,
                                share=lambda _: verifier.runs() if verifier is not None else None)
        if verifier is None:
            return
        # each file's finisher joins what every rank hashed of it and reads only the rest
        mine = {rel: [run for runs in hashed for run in runs.get(rel, ())] for rel in finishers(hashed)[_dist.rank()]}

        def finish() -> None:
            found = verifier.finish(mine)
            if found:
                raise CheckpointCorruptError(f"{len(found)} file(s) do not match their checksums: " + "; ".join(found[:3]))

        _dist.run_collectively("verifying checksums", finish)

    def _name_fields(self, step_dir: Path, manifest: Manifest) -> dict[str, Any]:
        fields_ = parse_step_name(self.config.name_template, step_dir.name, self.config.auto_insert_field_names) or {}
        for key in ("step", "epoch"):
            if key in fields_ and fields_[key] != getattr(manifest, key) and _dist.rank() == 0:
                self.log.warning("%s: its name says %s=%s but its manifest says %s; using the manifest",
                                 step_dir, key, fields_[key], getattr(manifest, key))
        return fields_

    def _load_model(self, step: Folder, manifest: Manifest, target: dict[str, Any], signatures: list[Any],
                    share: "shared_reads.SharedReads") -> None:
        t = self.tracked
        assert t.model_state is not None
        entry = _entry(step.path, manifest, "model")
        fmt = registry.get(entry.format)
        if not self.options.plain:
            self._load_model_partially(step, entry, fmt, target)
            return
        self._report.loaded = sorted(target)
        strict = self.config.strict and not self.config.is_peft
        try:
            checked = _check_signature(step.path, manifest, signatures, strict)
        except CheckpointMismatchError:  # every rank raised: refuse with the report's table, key by key
            refuse(plan_partially(step, entry.path, fmt, target, self.options)[2], step.path)
            raise  # the manifest and the files disagree: the manifest's verdict stands
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
        if not fast:
            template = optim_state.state_dict()["optim"]
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
        return lambda: apply_state(_Apply(optim_state) if fast else optim_state, target, folder.path)

def _read_objects(restorer: Restorer, step: Folder, manifest: Manifest) -> dict[str, tuple[str, Any]]:
    """The saved state of every registered object on this rank, read and decoded but not yet applied."""
    rank, world = _dist.rank(), _dist.world_size()
    out: dict[str, tuple[str, Any]] = {}
    for name in restorer.tracked.objects:
        if not restorer.options.wants(name):
            continue
        entry = manifest.states.get(name)
        if entry is None and name in manifest.pruned:
            _entry(step.path, manifest, name)  # raises: pruned from the checkpoint
        if entry is None:
            if rank == 0:
                restorer.log.warning("%s has no %r state; %s keeps its current state", step.path, name, name)
            continue
        rel: str | None = entry.path
        if entry.per_rank and entry.identical:  # the same state on every rank: any copy will do
            rel = entry.file_of(min(rank, manifest.world_size - 1))
        elif entry.per_rank:
            rel = entry.file_of(rank)
            if manifest.world_size != world:
                if rank == 0:
                    lo, hi = sorted((world, manifest.world_size))
                    who, own = (f"rank {lo}", "keeps its") if hi - lo == 1 else (f"ranks {lo}-{hi - 1}", "keep their")
                    rest = f"{who} {own} own" if world > lo else f"the states of {who} are not used"
                    restorer.log.warning("%s: %r was saved per rank on %d rank(s) and is restored on %d; each rank "
                                     "takes the state saved by the same rank number, %s",
                                     step.path, name, manifest.world_size, world, rest)
                if rank >= manifest.world_size:
                    rel = None
        if rel is not None:
            out[name] = (rel, _read_small(step, rel, entry))
    return out


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
    needs: "shared_reads.Described | None" = None
    """What this rank fills and where it runs, for sharing the reads (:func:`.shared_reads.describe_load`)."""


def _plan_optimizer(optim_state: Any, step: Folder, manifest: Manifest) -> "_OptimPlan":
    """This rank's plan of the optimizer's load (no collective): its format, its folder, the checkpoint's index
    of it, and targets allocated from that index, shaped and sharded like their parameters (``None`` when the
    state holds something that path does not cover)."""
    entry = _entry(step.path, manifest, "optim")
    fmt = registry.get(entry.format)
    folder = step.sub(entry.path)
    saved = {k[len(OPTIM_KEY):]: v for k, v in fmt.state_index(folder).items() if k.startswith(OPTIM_KEY)}
    return _OptimPlan(fmt, folder, saved, optim_state.template(saved))


def _entry(step_dir: Path, manifest: Manifest, key: str) -> StateEntry:
    entry = manifest.states.get(key)
    if entry is None and key in manifest.pruned:
        from .prune_optim import pruned_message

        raise CheckpointMismatchError(pruned_message(step_dir, manifest, key))
    if entry is None:
        raise CheckpointMismatchError(f"{step_dir} holds no {key!r} state (it has {sorted(manifest.states)}); "
                                      f"it was saved without one, so it cannot restore this run's {key}")
    return entry


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


def _read_small(step: Folder, rel: str, entry: StateEntry) -> Any:
    """A small state: its own ``.pt`` file, or a value kept inside another state's folder (``entry.key``)."""
    if entry.key is not None:
        return registry.get(entry.format).read_value(step.sub(rel), entry.key)
    return pt_format.load_from(step, rel)


OPTIM_KEY = "optim."


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class _Apply:
    """``load_state_dict`` for a template filled on the fast path (see :class:`~ckptio.state.OptimizerState`)."""

    def __init__(self, optim_state: Any) -> None:
        self.optim_state = optim_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim_state.apply(state["optim"])


def apply_state(obj: Any, state: Any, source: Path) -> None:
    """``obj.load_state_dict(state)``; a state that does not fit (a damaged or foreign file) is an error naming it."""
    try:
        obj.load_state_dict(state)
    except CheckpointError:
        raise
    except Exception as exc:  # the file decoded but holds something this object cannot take
        raise CheckpointCorruptError(f"{source}: the saved state does not fit {type(obj).__name__}.load_state_dict "
                                     f"({type(exc).__name__}: {exc})") from exc
