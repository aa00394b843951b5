"""Goodput: what checkpointing costs a run, recorded (:mod:`.record`), and the interval that pays (:mod:`.interval`);
the save on preemption (:mod:`.preemption`) is judged against the recorded cost.

:class:`Goodput` is the manager's part of it: it writes the run's record (a ``start`` when the manager is made,
every save and restore, the newest step reached, an ``end`` at a clean close) and, for each tier whose interval is
``"auto"``, keeps an :class:`~.interval.IntervalPlanner` and hands rank 0's choice to every rank at points they all
reach together: the third step of the process, and the end of each save.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import time
import weakref
from typing import Any

from pathlib import PurePosixPath

from .. import _dist
from ..errors import CheckpointError
from ..storage import url_scheme
from ..engine.layout import parse_step_name
from .audit import ResumeAudit
from .interval import DEFAULT_MEMORY_SHARE, IntervalPlanner, basis, parse_duration, plan_two_tiers
from .record import RunRecord

__all__ = ["Goodput", "RunRecord", "IntervalPlanner", "process_age_s"]

_FIRST_CHOICE_TICK = 3
"""The step (counted in this process) at which the first interval is chosen: two step times are known by then."""


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; elsewhere since ckptio was imported)."""
    try:
        with open("/proc/self/stat") as fh:
            started_ticks = float(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


class Goodput:
    """The run's record and the automatic intervals of one manager (``state_bytes``: the model and optimizer state
    this rank saves, for the cost assumed before the first save is measured)."""

    def __init__(self, config: Any, storage: Any, step_scheduler: Any, log: logging.Logger, model: Any,
                 saver: Any) -> None:
        self.log, self.names, self.storage = log, (config.name_template, config.auto_insert_field_names), storage
        self.record = RunRecord(storage, writer=_dist.rank() == 0, log=log) \
            if config.run_record and config.enabled else None
        kind = url_scheme(str(config.checkpoint_dir)) or "local"  # an object store's scheme: s3, gs, az
        saver.on_commit = functools.partial(self.committed, storage=kind)  # no cycle through the manager
        state_bytes = _state_bytes(model)
        self.listeners: list[Any] = []
        """Called with each event (a dict: ``kind``, ``time``, its numbers) on the rank that made it."""
        self.emit("start", ranks=_dist.world_size(), age_s=round(process_age_s(), 3))
        mtbf = parse_duration(config.mtbf, "mtbf") if config.mtbf is not None else None
        sched_auto = getattr(step_scheduler, "ckpt_every_steps", None) == "auto"
        automatic = config.persist_every_steps == "auto" or config.memory_every_steps == "auto" or sched_auto
        # the record's history serves an automatic interval only (without one, a rank other than 0 never reads it)
        history = self.record if automatic else None
        learned = history.learned_mtbf() if history is not None else None
        failures, up = history.failures() if history is not None else (0, 0.0)
        wanted = mtbf is None and automatic
        if wanted and failures and learned is None:
            log.warning("The run's record gives no usable failure rate (%s); the interval assumes the default one "
                        "failure a day (set mtbf= to give yours)", basis(failures, up))
        elif wanted and learned is not None:
            log.info("Mean time between failures learned from the run's record: %s (this process's running adds to "
                     "it as it goes; set mtbf= to give yours)", basis(failures, up))
        self.planners: dict[str, IntervalPlanner] = {}
        durable_rate = 5e9 if config.async_save else 1e9  # bytes a second, until a save is measured
        for tier, auto, rate in (("durable", config.persist_every_steps == "auto" or
                                  (config.persist_every_steps is None and sched_auto), durable_rate),
                                 ("memory", config.memory_every_steps == "auto", 5e9)):
            if auto and config.enabled:
                self.planners[tier] = IntervalPlanner(
                    tier, mtbf_s=mtbf, learned_mtbf_s=learned, min_steps=config.auto_min_steps,
                    max_steps=config.auto_max_steps, first_cost_s=max(0.01, state_bytes / rate), log=log,
                    learned_failures=failures)
                if self.record is not None:  # what this run's saves cost before it restarted
                    self.planners[tier].costs.extend(e["blocked_s"] for e in self.record.saves(tier)[-20:]
                                                     if "blocked_s" in e)
        self._memory_recovers = config.memory_recovers
        self.audit = ResumeAudit(config.audit_steps, config.audit_tolerance, self.record, self.emit, log, saver.tracked)
        if sched_auto:
            step_scheduler.auto = self
        self._ticks, self.closed = 0, False
        self._last_tick: int | None = None
        atexit.register(_at_exit, weakref.ref(self))  # a script that never closes its manager ends cleanly too

    @functools.cached_property
    def memory_share(self) -> tuple[float, str]:
        """The share of failures the memory tier recovers from, and where it comes from (:func:`_memory_share`;
        rank 0's choice of two automatic intervals)."""
        return _memory_share(self._memory_recovers, self.record)

    def emit(self, kind: str, *, lazy: bool = False, background: bool = False, begin: bool | None = None,
             **values: Any) -> None:
        """One event: into the record (rank 0 writes it, once the run saved or restored; ``lazy``: with a later
        write; ``background``: by the record's thread; ``begin``: whether this event starts the writing, by default a
        save's or a restore's) and to every listener; a listener's error is logged."""
        values["time"] = round(time.time(), 3)
        if self.record is not None:
            if kind in ("save", "restore") if begin is None else begin:
                self.record.begin()
            self.record.add(kind, lazy=lazy, background=background, **values)
        for listener in list(self.listeners):
            try:
                listener({"kind": kind, **values})
            except Exception as exc:  # a logger of the user's must not stop a save
                self.log.warning("A checkpoint event listener failed (%s: %s)", type(exc).__name__, exc)

    # ---------------------------------------------------------------------------------------------- the loop
    def tick(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        """Every rank, once per training step (repeated calls for one step count once); collective at the
        process's third step when an interval is automatic. ``metrics``: the loop's, for the resume audit."""
        if step == self._last_tick:
            return
        self._last_tick = step
        self._ticks += 1
        self.audit.tick(step, metrics)
        if self.record is not None:
            self.record.progress(step)
        for planner in self.planners.values():
            planner.step_reached(step)
        if self._ticks == _FIRST_CHOICE_TICK:
            self.sync()

    def sync(self) -> None:
        """Collective: every rank takes rank 0's choice of each automatic interval."""
        if not self.planners:
            return
        choices = self._choices() if _dist.rank() == 0 else None
        choices = _dist.broadcast_object(choices) if _dist.world_size() > 1 else choices
        for tier, planner in self.planners.items():
            planner.agree((choices or {}).get(tier))

    def _choices(self) -> dict[str, int | None]:
        """Rank 0: each automatic tier's interval; with both tiers automatic, chosen together."""
        if "memory" in self.planners and "durable" in self.planners:
            mem, dur = plan_two_tiers(self.planners["memory"], self.planners["durable"], *self.memory_share)
            return {"memory": mem, "durable": dur}
        return {tier: p.choice() for tier, p in self.planners.items()}

    def due(self, tier: str, step: int) -> bool | None:
        """Whether the automatic ``tier`` saves at ``step`` (``None`` when its interval is not automatic)."""
        planner = self.planners.get(tier)
        return None if planner is None else planner.due(step)

    # ---------------------------------------------------------------------------------------------- events
    def saved(self, tier: str, step: int, blocked_s: float) -> None:
        """Every rank, at the end of ``save()`` / ``save_memory()`` (collective when an interval is automatic)."""
        planner = self.planners.get(tier)
        self.audit.saved(step)  # a resume from either tier is audited against the steps after it
        if planner is not None:
            planner.saved(step, blocked_s)
            if tier == "durable" and "memory" in self.planners:  # a durable save is also the newest snapshot
                self.planners["memory"].last_saved = step
            self.sync()
        if tier == "memory":
            self.emit("save", lazy=True, background=True, step=step, tier="memory", blocked_s=round(blocked_s, 6),
                      ranks=_dist.world_size())

    def committed(self, job: Any, files: dict[str, int], removed: list[Any], storage: str) -> None:
        """Rank 0: a durable save is committed (possibly on the background writer's thread) and retention removed
        ``removed`` (a ``remove`` event each, with its step when its name gives one)."""
        total = time.perf_counter() - (job.called if job.called is not None else job.start)
        blocked = job.blocked_s if job.blocked_s is not None else total
        self.emit("save", step=job.step, tier="durable", blocked_s=round(blocked, 6), total_s=round(total, 6),
                  bytes=sum(files.values()), files=len(files), storage=storage, ranks=_dist.world_size())
        for path in removed:
            fields = parse_step_name(self.names[0], PurePosixPath(str(path)).name, self.names[1]) or {}
            step = fields.get("step")
            values: dict[str, Any] = {"step": step} if isinstance(step, int) and step >= 0 else {}
            self.emit("remove", lazy=False, **values)

    def restored(self, info: Any, restore_s: float) -> None:
        """Every rank, after a restore: the record says from which step, how many steps were lost, how long. From a
        checkpoint another tool wrote (a DeepSpeed run, an adopted AutoModel step, a ``restore_from=`` path), the
        folder is left as it was until ckptio saves there: the event is written with the first save."""
        for planner in self.planners.values():
            planner.last_saved = info.step
        # what the record says (another rank reads it for this only when a listener is told the steps lost)
        reads = self.record is not None and (self.record.writer or bool(self.listeners))
        newest = self.record.newest_step() if reads else None  # type: ignore[union-attr]
        self.emit("restore", step=info.step, tier=info.tier, restore_s=round(restore_s, 6),
                  startup_s=round(process_age_s(), 3),
                  **({"steps_lost": max(0, newest - info.step)} if newest is not None else {}), begin=self._own(info))
        self.audit.restored(info)

    def _own(self, info: Any) -> bool:
        """Whether ``info`` came from a checkpoint ckptio wrote: a memory snapshot, or a step directory with its own
        manifest (not another tool's: a DeepSpeed run, an adopted AutoModel step, which say their ``source_format``)."""
        if info.tier == "memory":
            return True
        if "source_format" in info.counters:
            return False
        from ..engine.manifest import MANIFEST_NAME
        from ..storage import open_storage

        try:
            where = self.storage if info.path.parent == self.storage.root else open_storage(info.path.parent)
            return where.folder(info.path.name).kind(MANIFEST_NAME) == "file"
        except (CheckpointError, OSError):
            return False

    def close(self, clean: bool) -> None:
        """The manager is closed: a clean end is recorded (a process that ends otherwise was a failure)."""
        if not self.closed:
            self.closed = True
            self.audit.finish()
            if clean:
                self.emit("end")
            if self.record is not None:
                self.record.close()  # the snapshots' events held back, what its thread was asked: on disk

    def flush(self) -> None:
        """The record on disk holds every event made so far (``CheckpointManager.wait``)."""
        if self.record is not None:
            self.record.flush()


def _at_exit(ref: "weakref.ref[Goodput]") -> None:
    goodput = ref()
    if goodput is not None:
        goodput.close(not hasattr(sys, "last_value"))  # set by the interpreter when an error ended the script


def _memory_share(given: float | None, record: RunRecord | None) -> tuple[float, str]:
    """The share of failures the memory tier recovers from, and where it comes from: given, or learned from the
    record's restores after failures (each counted against two assumed ones at :data:`DEFAULT_MEMORY_SHARE`)."""
    if given is not None:
        return float(given), "given"
    memory, total = record.recoveries() if record is not None else (0, 0)
    if not total:
        return DEFAULT_MEMORY_SHARE, "assumed: set memory_recovers="
    return (memory + 2 * DEFAULT_MEMORY_SHARE) / (total + 2), f"learned from {total} restore(s) after failures"


def _state_bytes(model: Any) -> int:
    """The bytes of ``model``'s parameters on this rank, times three (weights and Adam's two moments): what a save
    is assumed to write until one is measured."""
    if model is None:
        return 0
    local = 0
    for p in model.parameters():
        part = p.to_local() if hasattr(p, "to_local") else p
        local += part.numel() * part.element_size()
    return 3 * local
