"""The run's record: every save, restore, start and clean end of a run, kept beside its checkpoints.

``.ckptio_record.json`` at the root of ``checkpoint_dir`` holds one list of events, replaced whole at each event
(written aside and renamed over it locally, one PUT in a bucket), so that a process killed while writing leaves the
previous record, never a torn one. Rank 0 writes it; every rank reads it through the read gate (size cap, JSON
nesting bound, typed fields), rank 0 when its manager is made, the others when they first need its events. A record that cannot be read is refused naming the file and what is wrong, moved
aside (``.ckptio_record.json.damaged-<time>``, nothing is lost) and a new one begins: the record never stops training.

Events (all with ``kind`` and ``time``, seconds since the epoch):

* ``start``: a process of the run began (``ranks``; ``age_s``: how long the process had been running, imports and
  set-up, when its manager was made); a ``start`` with no ``end`` since the previous one was a
  failure, which is how the run learns its mean time between failures (:meth:`RunRecord.failures`);
* ``save``: ``step``, ``tier`` (``durable`` or ``memory``), ``blocked_s`` (what the training loop waited),
  ``total_s`` (till committed, when known), ``bytes``, ``files``, ``storage`` (``local``, ``s3``, ``gs``, ``az`` or
  ``abfs``), ``ranks``;
* ``restore``: ``step`` resumed from, ``tier``, ``steps_lost`` (the newest step the run is known to have reached
  before, minus that step), ``restore_s``, ``startup_s`` (from the process's start to the end of the restore);
* ``progress``: the newest step reached (written at most every :data:`PROGRESS_EVERY_S` seconds, replacing the
  previous one), so that a failure's lost steps are known;
* ``save_failed``: a save of ``tier`` (of ``step``, when known) failed and training went on (``failed_saves_allowed``);
* ``remove``: retention removed the checkpoint of ``step`` (when its name gives the step);
* ``end``: the run's processes closed their manager without an error;
* ``metrics``: what the loop reported of ``step`` (``loss``, ``grad_norm``, ``lr``: a number, or ``"nan"``, ``"inf"``,
  ``"-inf"``), for the first ``audit_steps`` steps after each durable save and memory snapshot (:mod:`.audit`);
* ``audit``: a resume from ``step`` compared with the run that stopped: ``verdict`` (``exact``, ``tolerance``,
  ``diverged``), ``checked`` (steps compared), ``tolerance``; when diverged, ``at`` (the step), its values now and as
  recorded (``loss`` and ``loss_was``...) and the likely ``causes`` (names of :data:`.audit.CAUSES`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..storage.parse import as_float, as_int, field, json_object
from .record_writer import BackgroundWrites

__all__ = ["RECORD_NAME", "RunRecord", "MAX_EVENTS", "PROGRESS_EVERY_S", "failure_history"]

RECORD_NAME = ".ckptio_record.json"
MAX_EVENTS = 4096
"""Events kept; past it the oldest saves are dropped first (starts, ends and restores are what the MTBF needs)."""
MAX_RECORD_BYTES = 4 << 20
PROGRESS_EVERY_S = 30.0
_KEEP_ASIDE_BYTES = 64 << 20
_MAX_SECONDS = 1e12
"""Times and durations beyond it (the year 33,658; 31,000 years) are not what ckptio writes: refused, so that no sum
of a record's numbers can overflow what reads it (the report)."""
_CLOCK_SLACK_S = 1.0
"""An event stamped up to this much after now is still counted (times are rounded to the millisecond, and the nodes
of a job may differ by a little): what a forged stamp can add to the uptime."""
_KINDS = ("start", "save", "save_failed", "restore", "progress", "remove", "end", "metrics", "audit")
_NUMBERS = ("time", "blocked_s", "total_s", "restore_s", "startup_s", "age_s")
_COUNTS = ("step", "bytes", "files", "ranks", "steps_lost", "at", "checked")
_TEXTS = {"tier": ("durable", "memory"), "storage": ("local", "s3", "gs", "az", "abfs"),
          "verdict": ("exact", "tolerance", "diverged")}
_METRICS = ("loss", "grad_norm", "lr", "loss_was", "grad_norm_was", "lr_was")
"""The resume audit's values: any finite number, or ``"nan"``, ``"inf"``, ``"-inf"``."""


class RunRecord:
    """The record of the run whose checkpoints are in ``storage``; ``writer``: this process writes it (rank 0), and
    reads it when made. Another process reads it when its events are first needed (:attr:`events`: an automatic
    interval's history, a listener's ``restore`` event), the events it added before then added after the record's:
    a save or a restore on N ranks asks the store for the record once, not N times (a listing and a read, ~1-3 ms of
    a client's CPU each, on every rank of every save and restore)."""

    def __init__(self, storage: Any, *, writer: bool, log: logging.Logger) -> None:
        self.storage, self.writer, self.log = storage, writer, log
        self.where = storage.root / RECORD_NAME
        self.broken = False
        """The record cannot be written (a folder in its place, one too large to keep aside): said once, then
        kept in memory only."""
        self.deferred = True
        """Nothing is written, moved aside or swept until the run has saved or restored (:meth:`begin`): a process
        that only fails to find a checkpoint leaves the folder exactly as it was."""
        self._refused = False
        self._lock = threading.Lock()  # the background writer records its commits from its own thread
        self._events: list[dict[str, Any]] | None = None
        self._encoded: list[str] = []
        """Each event as JSON, made once: the record is rewritten at each event, and a dump of 4,096 events costs
        ~20 ms here, their join a fraction of one."""
        self._later: list[dict[str, Any]] = []
        """A reader's events added before it read the record (added after the record's when it does)."""
        self._progress_at = 0.0
        self._written_at = 0.0
        self._held = False
        self._io = threading.Lock()
        """Held while the record is written: one write at a time, in the order of the events they hold."""
        self._made = self._written = 0
        """Events added, and added when the record on disk was made: an older record never replaces a newer."""
        self._writes = BackgroundWrites(self._write_newest, "ckptio-record")
        if writer:
            self._load()
        _RECORDS.add(self)

    # -------------------------------------------------------------------------------------------- reading
    @property
    def events(self) -> list[dict[str, Any]]:
        """The record's events then this process's (read from the store at the first call, on a reader)."""
        if self._events is None:
            with self._lock:
                if self._events is None:
                    self._load()
        return self._events  # type: ignore[return-value]

    def _load(self) -> None:
        events = self._read()
        self._events, self._encoded = events, [_encode(e) for e in events]
        later, self._later = self._later, []
        for event in later:
            self._append(event)
            self._made += 1

    def _read(self) -> list[dict[str, Any]]:
        folder = self.storage.folder()
        try:
            if folder.kind(RECORD_NAME) is None:
                return []
            data = folder.read_bytes(RECORD_NAME, max_size=MAX_RECORD_BYTES)
            return parse(data, self.where)
        except (CheckpointError, OSError) as exc:
            self.log.warning("The run's record %s is refused (%s); it is kept aside and a new one begins: training "
                             "goes on", self.where, exc)
            self._refused = True
            return []

    def _move_aside(self) -> None:
        """Keep the refused record's bytes under another name before a new record replaces it; one that cannot be
        kept (too large, not a file or link) is left alone and the record is not written."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        folder = self.storage.folder()
        try:
            kind = folder.kind(RECORD_NAME)
            if kind not in ("file", "link"):
                raise CheckpointError(f"a {kind} is where the record belongs")
            data = folder.read_bytes(RECORD_NAME, max_size=_KEEP_ASIDE_BYTES) if kind == "file" else b""
            self.storage.write_small(f"{RECORD_NAME}.damaged-{stamp}", data)
        except (CheckpointError, OSError) as exc:
            self.broken = True
            self.log.warning("The refused record %s is left as it is (%s); this run's record is kept in memory only",
                             self.where, exc)

    def _sweep(self) -> None:
        """Remove what a process killed while writing the record left locally (``.ckptio_record.json.*.tmp``)."""
        root = self.storage.root
        if not isinstance(root, Path):
            return  # a bucket: one PUT per event leaves nothing behind
        try:
            leftovers = list(root.glob(f".{RECORD_NAME}.*.tmp")) if root.is_dir() else []
            for path in leftovers:
                if path.is_file() and not path.is_symlink():
                    path.unlink()
        except OSError:
            pass

    # -------------------------------------------------------------------------------------------- writing
    def add(self, kind: str, *, lazy: bool = False, background: bool = False, **values: Any) -> None:
        """Append an event (``time``: now, unless given) and write the record (rank 0); a write that fails is logged,
        never raised: the record must not stop training. ``lazy``: written with the next event that is not, or once
        :data:`PROGRESS_EVERY_S` seconds have passed since the last write (a memory-tier snapshot's event: the
        training thread makes it, and a write costs milliseconds next to a snapshot's few). ``background``: written
        by the record's own thread (:mod:`.record_writer`; the resume audit's values, the progress), the newest
        record wins; :meth:`flush` and :meth:`close` wait for it."""
        with self._lock:
            self._add({"kind": kind, "time": round(time.time(), 3), **values},
                      lazy and time.monotonic() - self._written_at < PROGRESS_EVERY_S, background)

    def _add(self, event: dict[str, Any], held: bool = False, background: bool = False) -> None:
        if self._events is None:
            if not self.writer:  # a reader that has not read the record yet
                self._later.append(event)
                return
            self._load()
        self._append(event)
        self._made += 1
        self._held = held
        if not self.writer or self.broken or self.deferred or held:
            return
        if not (background and self._writes.request()):
            self._write()

    def _append(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "progress" and self.events and self.events[-1]["kind"] == "progress":
            self.events[-1], self._encoded[-1] = event, _encode(event)
        else:
            self.events.append(event)
            self._encoded.append(_encode(event))
        while len(self.events) > MAX_EVENTS:  # the oldest audit values first (their checkpoints are gone), then saves
            oldest = next((i for i, e in enumerate(self.events) if e["kind"] == "metrics"), None)
            oldest = next((i for i, e in enumerate(self.events) if e["kind"] in ("save", "progress")), 0) \
                if oldest is None else oldest
            del self.events[oldest], self._encoded[oldest]

    def flush(self) -> None:
        """Write the events held back (``lazy``), if any, and wait for the record's thread to write what it was
        asked to: the record on disk then holds every event added before."""
        with self._lock:
            if self._held and self.writer and not self.broken and not self.deferred:
                self._held = False
                self._write()
        self._writes.wait()

    def close(self) -> None:
        """:meth:`flush`, and end the record's thread (the events added later are written by their caller)."""
        self.flush()
        self._writes.close()

    def _write(self) -> None:
        """The record now, on the caller's thread (holding ``_lock``)."""
        self._writes.cancel()
        self._put(_HEAD + ",".join(self._encoded).encode() + b"]}", self._made)

    def _write_newest(self) -> None:
        """On the record's thread: the record as it is now (the events held back too)."""
        with self._lock:
            if not self.writer or self.broken or self.deferred:
                return
            self._held = False
            made, encoded = self._made, list(self._encoded)  # the join, the bulk of it, off the lock
        self._put(_HEAD + ",".join(encoded).encode() + b"]}", made)

    def _put(self, data: bytes, made: int) -> None:
        with self._io:
            if made <= self._written:
                return  # a newer record is on disk already
            self._written_at = time.monotonic()
            try:
                self.storage.write_small(RECORD_NAME, data)
                self._written = made
            except FileNotFoundError:
                pass  # the folder is made by the first save: the events are written with the next one after it
            except (CheckpointError, OSError) as exc:
                self.broken = True
                self.log.warning("Could not write the run's record %s (%s); it is kept in memory only, training "
                                 "goes on", self.where, exc)

    def _forked(self) -> None:
        """In a forked child: the locks may have been held by a thread of the parent at the fork."""
        self._lock, self._io = threading.Lock(), threading.Lock()

    def begin(self) -> None:
        """The run saved or restored: from the next event on, the record is written (with the events held so far),
        after a refused one is kept aside and what a killed writer left is swept."""
        if not self.deferred:
            return
        self.deferred = False
        if self.writer:
            if self._refused:
                self._move_aside()
            self._sweep()

    def progress(self, step: int) -> None:
        """The run reached ``step``: recorded at most every :data:`PROGRESS_EVERY_S` seconds."""
        now = time.monotonic()
        if now - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = now
            self.add("progress", background=True, step=step)

    # -------------------------------------------------------------------------------------------- what it says
    def newest_step(self) -> int | None:
        """The newest step the run is recorded to have reached (saves and progress)."""
        steps = [e["step"] for e in self.events if e["kind"] in ("save", "progress", "restore") and "step" in e]
        return max(steps) if steps else None

    def failures(self, now: float | None = None) -> tuple[int, float]:
        """How many of the run's processes ended without an ``end`` (each followed by a new ``start``), and the
        seconds the run was seen up in all (:func:`failure_history`)."""
        return failure_history(self.events, time.time() if now is None else now)

    def learned_mtbf(self) -> float | None:
        """Seconds of running per failure, once a failure is recorded; ``None`` when the record gives no usable
        rate (failures in no time running: below :data:`~.interval.MIN_MTBF_S`), for the default to stand."""
        from .interval import MIN_MTBF_S

        failures, up = self.failures()
        mtbf = up / failures if failures else None
        return mtbf if mtbf is not None and math.isfinite(mtbf) and mtbf >= MIN_MTBF_S else None

    def recoveries(self) -> tuple[int, int]:
        """The restores that followed a failure: how many came from the memory tier, and how many in all."""
        memory = total = 0
        failed_before, open_process, counted = False, False, True
        for event in self.events:
            if event["kind"] == "start":
                failed_before, open_process, counted = open_process, True, False
            elif event["kind"] == "end":
                open_process = False
            elif event["kind"] == "restore" and failed_before and not counted:
                counted = True
                total += 1
                memory += event.get("tier") == "memory"
        return memory, total

    def saves(self, tier: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == "save" and e.get("tier") == tier]


def failure_history(events: list[dict[str, Any]], now: float) -> tuple[int, float]:
    """The failures in ``events`` (a ``start`` with no ``end`` since the previous one) and the seconds the run was
    up (each process from its ``start`` to its last event), from what the record can have seen: an event stamped
    after ``now`` or before the record's first event is not counted, and each process's span begins no earlier than
    the newest event before it, so that the uptime is never more than ``now`` minus the record's start, whatever
    the stamps (a forged record, a clock set wrong). The current process, when ``events`` end with its ``start``,
    is up, not failed: the caller counts its running (a censored estimate)."""
    failures, up, began, last = 0, 0.0, None, None
    start = newest = None
    for event in events:
        stamp = event["time"]
        if not stamp <= now + _CLOCK_SLACK_S or (start is not None and stamp < start):
            continue  # never seen: after now, or before the record began
        start = stamp if start is None else start
        stamp = newest = stamp if newest is None else max(newest, stamp)
        if event["kind"] == "start":
            if began is not None and last is not None:
                up += last - began
                failures += 1
            began, last = stamp, stamp
        elif began is not None:
            last = stamp
            if event["kind"] == "end":
                up += last - began
                began = None
    if began is not None and last is not None:
        up += last - began
    return failures, up


_RECORDS: "weakref.WeakSet[RunRecord]" = weakref.WeakSet()


def _after_fork() -> None:
    for record in list(_RECORDS):
        record._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

_HEAD = b'{"format":"ckptio-record","version":1,"events":['


def _encode(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"))


def dump(events: list[dict[str, Any]]) -> bytes:
    """The bytes of a record holding ``events``."""
    return _HEAD + ",".join(_encode(e) for e in events).encode() + b"]}"


def parse(data: bytes, where: object) -> list[dict[str, Any]]:
    """The events of a record, each checked: a known kind and, for every field it has, the right type and range."""
    obj = json_object(data, where, "run record ")
    if obj.get("format") != "ckptio-record" or obj.get("version") != 1:
        raise CheckpointError(f"{where}: not a ckptio run record of version 1")
    events = field(obj, "events", list, where)
    if len(events) > MAX_EVENTS:
        raise CheckpointError(f"{where}: {len(events)} events, more than the {MAX_EVENTS} a record keeps")
    return [_event(e, f"{where}: event {i}") for i, e in enumerate(events)]


def _event(event: Any, where: str) -> dict[str, Any]:
    kind = field(event, "kind", str, where)
    if kind not in _KINDS:
        raise CheckpointError(f"{where}: unknown kind {kind[:40]!r}")
    out: dict[str, Any] = {"kind": kind}
    for name, value in event.items():
        if name in _NUMBERS:
            number = as_float(value, where, name)
            if not 0 <= number <= _MAX_SECONDS:
                raise CheckpointError(f"{where}: {name} must be a number of seconds in [0, {_MAX_SECONDS:g}], found "
                                      f"{number:g}")
            out[name] = number
        elif name in _COUNTS:
            out[name] = as_int(value, where, name)
        elif name in _METRICS:
            out[name] = _metric(value, where, name)
        elif name == "tolerance":
            out[name] = as_float(value, where, name)
            if not 0 <= out[name] <= 1:
                raise CheckpointError(f"{where}: tolerance must be in [0, 1], found {out[name]:g}")
        elif name == "causes":
            out[name] = _causes(value, where)
        elif name in _TEXTS:
            if value not in _TEXTS[name]:
                raise CheckpointError(f"{where}: {name} must be one of {', '.join(_TEXTS[name])}, found {value!r:.40}")
            out[name] = value
        elif name != "kind":
            raise CheckpointError(f"{where}: unknown field {str(name)[:40]!r}")
    if "time" not in out:
        raise CheckpointError(f"{where}: no time")
    return out


def _metric(value: Any, where: str, name: str) -> float | str:
    if value in ("nan", "inf", "-inf"):
        return str(value)
    number = as_float(value, where, name)
    if not math.isfinite(number):
        raise CheckpointError(f"{where}: {name} must be a finite number or \"nan\", \"inf\", \"-inf\"")
    return number


def _causes(value: Any, where: str) -> list[str]:
    from .audit import CAUSES

    if not isinstance(value, list) or len(value) > len(CAUSES) or len(set(map(str, value))) != len(value) \
            or not all(isinstance(v, str) and v in CAUSES for v in value):
        raise CheckpointError(f"{where}: causes must be a list of distinct names among {', '.join(CAUSES)}, found "
                              f"{str(value)[:80]}")
    return list(value)
