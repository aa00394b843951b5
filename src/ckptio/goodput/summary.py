"""What a run's record says, summed up: its processes, failures, saves, restores, removals, and its goodput.

The goodput is an estimate from the record alone: the share of the run's wall time (from its first process's start,
``age_s`` before its ``start`` event, to its last event) left once the time lost to checkpointing is taken out. Taken out are:

* ``blocked``: every save's ``blocked_s`` (what the training loop waited, both tiers);
* ``redone``: for each restore, its ``steps_lost`` times the run's step time (measured between the record's events
  of each process, the time its saves blocked taken out);
* ``restarting``: the time between a process's last event and the start of the next (its imports and set-up
  included) and each restore's time after the manager was made. The first process's set-up before its manager is
  the run's start (``setup_s``), not a restart: a run that never failed restarted for no time.

Failures before the run's first save or restore are not seen: the record begins then.

What the record cannot see (a failed process's work after its last event, within :data:`~.record.PROGRESS_EVERY_S`
seconds and before the next process began) is in none of these: ``unseen_s`` says how much that can be, and the
report gives it in steps beside the steps redone (the estimate errs on the high side by at most that).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from .record import PROGRESS_EVERY_S, failure_history, parse as parse_record

__all__ = ["Process", "Summary", "summarize", "load"]


@dataclass
class Process:
    """One process of the run: from its ``start`` to its last event; ``clean``: it recorded an ``end``."""

    start: float
    last: float
    clean: bool
    ranks: int | None
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Summary:
    """A run's record, summed up (times in seconds, ``time`` fields since the epoch)."""

    events: list[dict[str, Any]]
    processes: list[Process]
    saves: dict[str, list[dict[str, Any]]]
    restores: list[dict[str, Any]]
    removes: list[dict[str, Any]]
    wall_s: float
    blocked_s: float
    redone_s: float
    restarting_s: float
    step_s: float | None
    newest_step: int | None
    setup_s: float = 0.0
    """The first process's imports and set-up before its manager: the run's start, not a restart."""
    unseen_s: float = 0.0
    """Time before each failure the record cannot have seen (progress is written at most every
    :data:`~.record.PROGRESS_EVERY_S` seconds, and a process cannot have run past the next one's start)."""
    unknown_lost: int = 0
    """Restores whose steps lost are not known (nothing of the run before them was recorded)."""

    @property
    def unseen_steps(self) -> int | None:
        """The most steps the failures may have lost beyond ``steps_lost`` (``None``: no step time to say)."""
        if not self.unseen_s:
            return 0
        return int(min(10**12, -(-self.unseen_s // self.step_s))) if self.step_s else None

    @property
    def failed_saves(self) -> list[dict[str, Any]]:
        """Saves that failed while training went on (``failed_saves_allowed``), each with its ``tier`` and ``step``."""
        return [e for e in self.events if e["kind"] == "save_failed"]

    @property
    def audits(self) -> list[dict[str, Any]]:
        """The resume audits: each resume compared with the run that stopped (:mod:`.audit`)."""
        return [e for e in self.events if e["kind"] == "audit"]

    @property
    def failures(self) -> int:
        """Processes that ended without an ``end`` and were followed by another (stamps after now or before the
        record began not counted: :func:`~.record.failure_history`, what the ``"auto"`` interval learns from)."""
        return failure_history(self.events, time.time())[0]

    @property
    def mtbf_s(self) -> float | None:
        """Seconds of running per failure (``None`` before the first failure, or with no time running)."""
        failures, up = failure_history(self.events, time.time())
        return up / failures if failures and up > 0 else None

    @property
    def goodput(self) -> float | None:
        """The share of wall time spent on steps that were kept (``None`` for a run with no time recorded)."""
        if self.wall_s <= 0:
            return None
        lost = self.blocked_s + self.redone_s + self.restarting_s
        return max(0.0, min(1.0, (self.wall_s - lost) / self.wall_s))


def load(data: bytes, where: object) -> Summary:
    """The summary of the record ``data`` (read through the record's own checks: refused naming ``where``)."""
    return summarize(parse_record(data, where))


def summarize(events: list[dict[str, Any]]) -> Summary:
    """The summary of a record's checked events."""
    processes = _processes(events)
    saves: dict[str, list[dict[str, Any]]] = {"durable": [], "memory": []}
    for event in events:
        if event["kind"] == "save":
            saves[event.get("tier", "durable")].append(event)
    restores = [e for e in events if e["kind"] == "restore"]
    step_s = _step_time(processes)
    wall = processes[-1].last - processes[0].start if processes else 0.0
    downtime = sum(max(0.0, b.start - a.last) for a, b in zip(processes, processes[1:]))
    setups = [p.events[0]["time"] - p.start for p in processes]  # each process's imports and set-up
    startup = sum(setups[1:]) + sum(max(0.0, e["time"] - p.events[0]["time"]) for p in processes for e in p.events
                                    if e["kind"] == "restore")
    unseen = sum(min(PROGRESS_EVERY_S, max(0.0, b.start - a.last)) for a, b in zip(processes, processes[1:])
                 if not a.clean)
    steps = [e["step"] for e in events if "step" in e and e["kind"] in ("save", "progress", "restore")]
    return Summary(events=events, processes=processes, saves=saves, restores=restores,
                   removes=[e for e in events if e["kind"] == "remove"], wall_s=max(0.0, wall),
                   blocked_s=sum(e.get("blocked_s", 0.0) for tier in saves.values() for e in tier),
                   redone_s=sum(e.get("steps_lost", 0) for e in restores) * (step_s or 0.0),
                   restarting_s=downtime + startup, step_s=step_s, newest_step=max(steps) if steps else None,
                   setup_s=setups[0] if setups else 0.0, unseen_s=unseen,
                   unknown_lost=sum(1 for e in restores if "steps_lost" not in e))


def _processes(events: list[dict[str, Any]]) -> list[Process]:
    processes: list[Process] = []
    for event in events:
        if event["kind"] == "start" or not processes:  # the process began age_s before its manager
            began = event["time"] - event.get("age_s", 0.0)
            processes.append(Process(start=began, last=event["time"], clean=False, ranks=event.get("ranks")))
        current = processes[-1]
        current.events.append(event)
        current.last = max(current.last, event["time"])
        if event["kind"] == "end":
            current.clean = True
    return processes


def _step_time(processes: list[Process]) -> float | None:
    """Seconds per step: the median over processes of the time between their first and last step-bearing events
    (saves' blocked time taken out), per step advanced."""
    rates = []
    for process in processes:
        points = [(e["time"], e["step"]) for e in process.events
                  if e["kind"] in ("save", "progress", "restore") and "step" in e]
        if len(points) < 2 or points[-1][1] <= points[0][1]:
            continue
        blocked = sum(e.get("blocked_s", 0.0) for e in process.events if e["kind"] == "save"
                      and points[0][0] < e["time"] <= points[-1][0])
        span = points[-1][0] - points[0][0] - blocked
        if span > 0:
            rates.append(span / (points[-1][1] - points[0][1]))
    return statistics.median(rates) if rates else None
