"""Which checkpoints to keep: composable retention policies, decided from what is on disk.

A checkpoint is kept when any configured policy keeps it, and is never deleted when it is protected:
the newest committed checkpoint, the best one by the monitored metric, the one this run resumed from.
Directories that are not committed (temporaries of a save in flight, leftovers of a crash) are not
checkpoints and are never touched here. With no policy configured, everything is kept.

Everything is derived from manifests, so the decision is the same after a resume, after a crash, or
when another job wrote into the same folder.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Literal

from typing import TYPE_CHECKING

from ..errors import CheckpointError
from .layout import CheckpointEntry

if TYPE_CHECKING:
    from ..storage.base import Storage

Mode = Literal["min", "max"]


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep-rules; ``None`` turns a rule off. A checkpoint survives if any rule keeps it."""

    top_k: int | None = None
    """Keep the ``top_k`` best by ``monitor`` (checkpoints without the metric do not count)."""
    monitor: str | None = None
    mode: Mode = "min"
    keep_latest: int | None = None
    """Keep the ``keep_latest`` newest (by step)."""
    keep_every_n_steps: int | None = None
    """Keep checkpoints whose step is a multiple of this."""
    keep_newer_than_s: float | None = None
    """Keep checkpoints created less than this many seconds ago."""
    keep_optimizer_latest: int | None = None
    """Keep the optimizer state in the newest this many only (:mod:`.prune_optim`); deletes no checkpoint."""

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.top_k, self.keep_latest, self.keep_every_n_steps,
                                           self.keep_newer_than_s))


@dataclass
class RetentionDecision:
    """Which checkpoints a retention policy keeps and deletes, and why each kept one is kept."""
    keep: list[CheckpointEntry] = field(default_factory=list)
    delete: list[CheckpointEntry] = field(default_factory=list)
    reasons: dict[str, list[str]] = field(default_factory=dict)
    """Name -> why it is kept (``latest``, ``best``, ``top-3``, ``every-100``, ``resumed-from``…)."""


def metric_of(entry: CheckpointEntry, monitor: str | None) -> float | None:
    """The monitored metric of a committed checkpoint; ``None`` when it is missing or NaN."""
    if monitor is None or entry.manifest is None:
        return None
    value = entry.manifest.metrics.get(monitor)
    if value is None or math.isnan(value):
        return None
    return value


def best_checkpoint(entries: list[CheckpointEntry], monitor: str | None, mode: Mode) -> CheckpointEntry | None:
    """The best committed checkpoint by ``monitor``; ties go to the newer step."""
    scored = [(v, e) for v, e in ((metric_of(e, monitor), e) for e in entries) if v is not None]
    if not scored:
        return None
    sign = 1 if mode == "min" else -1
    return min(scored, key=lambda ve: (sign * ve[0], -(ve[1].step or 0)))[1]


def decide(entries: list[CheckpointEntry], policy: RetentionPolicy, *, protected: AbstractSet[str] = frozenset(),
           now: _dt.datetime | None = None) -> RetentionDecision:
    """Split committed ``entries`` into keep and delete under ``policy``; ``protected`` names are always kept."""
    # a step another tool wrote (NeMo AutoModel's, adopted for resuming) is never ranked or deleted here
    committed = sorted((e for e in entries if e.committed and not e.adopted), key=lambda e: (e.step or 0, e.name))
    decision = RetentionDecision()
    reasons = decision.reasons

    def mark(entry: CheckpointEntry, why: str) -> None:
        reasons.setdefault(entry.name, []).append(why)

    if committed:
        mark(committed[-1], "latest")
    best = best_checkpoint(committed, policy.monitor, policy.mode)
    if best is not None:
        mark(best, "best")
    for e in committed:
        if e.name in protected:
            mark(e, "protected")
    if not policy.active:
        for e in committed:
            mark(e, "no-policy")
    if policy.top_k is not None and policy.top_k > 0 and policy.monitor:
        sign = 1 if policy.mode == "min" else -1
        ranked = [(v, e) for v, e in ((metric_of(e, policy.monitor), e) for e in committed) if v is not None]
        scored = sorted(ranked, key=lambda ve: (sign * ve[0], -(ve[1].step or 0)))
        for _, e in scored[: policy.top_k]:
            mark(e, f"top-{policy.top_k}")
        # A checkpoint without the metric cannot be ranked. Deleting it is safe only once a newer ranked one
        # exists (then it is an older, unranked state); otherwise it is kept. So when no checkpoint has the
        # metric at all (a misspelt monitor), nothing is deleted on its account.
        newest_ranked = max(((e.step or 0) for _, e in scored), default=None)
        for e in committed:
            if metric_of(e, policy.monitor) is None and (newest_ranked is None or (e.step or 0) > newest_ranked):
                mark(e, f"unranked (no {policy.monitor})")
    if policy.keep_latest is not None and policy.keep_latest > 0:
        for e in committed[-policy.keep_latest:]:
            mark(e, f"latest-{policy.keep_latest}")
    if policy.keep_every_n_steps:
        for e in committed:
            if (e.step or 0) % policy.keep_every_n_steps == 0:
                mark(e, f"every-{policy.keep_every_n_steps}")
    if policy.keep_newer_than_s is not None:
        now = now or _dt.datetime.now(_dt.timezone.utc)
        for e in committed:
            created = _created(e)
            if created is None or (now - created).total_seconds() < policy.keep_newer_than_s:
                mark(e, "recent")
    for e in committed:
        (decision.keep if e.name in reasons else decision.delete).append(e)
    return decision


def _created(entry: CheckpointEntry) -> _dt.datetime | None:
    try:
        return _dt.datetime.fromisoformat(entry.manifest.created)  # type: ignore[union-attr]
    except (ValueError, AttributeError, TypeError):
        return None


def apply(storage: "Storage | Path", decision: RetentionDecision) -> list[Path]:
    """Delete what ``decision`` says through ``storage``, each made invisible before it is removed."""
    from .. import _faults

    storage = _storage(storage)
    removed = []
    for e in decision.delete:
        _faults.point("retention.before_delete")
        storage.remove_step(e.name)
        removed.append(e.path)
    return removed


def after_commit(storage: "Storage | Path", policy: RetentionPolicy, *,
                 protected: AbstractSet[str] = frozenset(), written: str | None = None) -> list[Path]:
    """After a commit (rank 0): move the BEST pointer, then delete what ``policy`` does not keep.

    The newest and the best are always kept, and so is every name in ``protected``, and the step just written:
    ``written``, which the commit pointed LATEST at before calling this (without it, the target of LATEST as read),
    even when a newer step lies in the folder (a run resumed from an older one). Returns what was removed.
    """
    if not policy.monitor and not policy.active and not policy.keep_optimizer_latest:
        return []  # nothing to decide: the folder is not scanned
    storage = _storage(storage)
    # a bucket's folder listed once, not step by step, and the manifests read before not fetched again
    with getattr(storage, "scanning", contextlib.nullcontext)():
        return _after_commit(storage, policy, protected, written)


def _after_commit(storage: "Storage", policy: RetentionPolicy, protected: AbstractSet[str],
                  written: str | None) -> list[Path]:
    from .layout import BEST, LATEST, committed_checkpoints

    entries = committed_checkpoints(storage)
    if policy.monitor:
        best = best_checkpoint(entries, policy.monitor, policy.mode)
        if best is not None:
            storage.write_pointer(BEST, best.name)
    if not policy.active and not policy.keep_optimizer_latest:
        return []
    latest: str | None
    if written is not None:
        latest = written  # the commit pointed LATEST at it just before: not read back (a request in a bucket)
    else:
        try:
            latest = storage.read_pointer(LATEST)
        except CheckpointError:  # the newest step cannot be told: delete nothing rather than it
            return []
    keep = set(protected) | {name for name in (written, latest) if name}
    removed = apply(storage, decide(entries, policy, protected=keep)) if policy.active else []
    if policy.keep_optimizer_latest:
        from .prune_optim import prune_optimizers

        gone = {p.name for p in removed}
        prune_optimizers(storage, [e for e in entries if e.name not in gone], policy.keep_optimizer_latest,
                         keep=frozenset(name for name in (written, latest) if name))
    return removed


def _storage(storage: "Storage | Path") -> "Storage":
    from ..storage import as_storage

    return as_storage(storage)
