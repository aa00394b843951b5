"""The resume audit: whether a resumed run continues the run that stopped (docs/goodput.md, "The resume audit").

For the first ``audit_steps`` steps after each durable save and each memory snapshot, rank 0 records what the loop
reports of them through ``maybe_save(metrics=...)`` (``loss``, and ``grad_norm`` and ``lr`` when given) as ``metrics``
events of the run's record, each step once however many windows hold it, the record written once at the last step of
each window (snapshots every few steps cost one write of the record each, no more), by the record's own thread: the
training thread pays no write (:mod:`.record_writer`). After a resume from step ``s``
(a durable checkpoint or a memory snapshot), the same steps after ``s`` are compared with what the run that stopped recorded
for them: the same bitwise (``exact``), within ``audit_tolerance`` (relative), or ``diverged`` at the first step that
is not, with both values of that step and the causes ckptio can see (a state the manager was not given, another
number of ranks, tensors cast on load, a partial load). Said once in the log, as an ``audit`` event in the record, and
by ``ckptio report``. Rank 0 only: the values are rank 0's own, and nothing here is a collective.
"""

from __future__ import annotations

import math
from typing import Any, Callable

__all__ = ["AUDITED", "CAUSES", "ResumeAudit", "encode", "decode", "describe"]

AUDITED = ("loss", "grad_norm", "lr")
"""The metrics of ``maybe_save(metrics=...)`` that are recorded and compared (others are left alone)."""
CAUSES = {
    "dataloader": "no data loader given to the manager (dataloader=): the data order is not resumed",
    "lr_scheduler": "no lr_scheduler given to the manager: the learning rate is not resumed",
    "rng": "the RNG streams not saved (rng=False; Lightning saves none): dropout and sampling are not resumed",
    "ranks": "another number of ranks than the save's",
    "dtype": "tensors cast to another dtype on load (load_cast_dtype)",
    "load_exclude": "model keys left out of the load (load_exclude, strict=False)",
    "load_states": "states left out of the load (load_states)",
}
"""The likely causes of a divergence that ckptio can see, by the name the record keeps."""
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
MAX_AUDIT_STEPS = 100


def encode(value: float) -> float | str:
    """A metric as the record keeps it: a finite number, or ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has none)."""
    return value if math.isfinite(value) else "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"


def decode(value: float | str) -> float:
    """A metric as the record keeps it, back to a ``float``."""
    return _NON_FINITE[value] if isinstance(value, str) else float(value)


def _same(was: float | str, now: float | str) -> bool:
    return was == now or (isinstance(was, float) and isinstance(now, float) and math.isnan(was) and math.isnan(now))


def _close(was: float | str, now: float | str, tolerance: float) -> bool:
    a, b = decode(was), decode(now)
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tolerance * max(abs(a), abs(b))


class ResumeAudit:
    """Rank 0's recording of the steps after each durable save and memory snapshot, and its check of a resumed
    run's."""

    def __init__(self, steps: int, tolerance: float, record: Any, emit: Callable[..., None], log: Any,
                 tracked: Any) -> None:
        self.steps, self.tolerance, self.record, self.emit, self.log = steps, tolerance, record, emit, log
        self.tracked = tracked
        self.on = bool(steps) and record is not None and record.writer
        self._windows: list[tuple[int, int]] = []
        """``(s, s + steps)`` of each save or snapshot of ``s`` whose steps after it are still to be recorded."""
        self._checking: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------- the run that saves
    def saved(self, step: int) -> None:
        """A durable save (called or committed) or a memory snapshot of ``step``: record the steps after it."""
        if self.on:
            self._windows = [w for w in self._windows if w[1] > step] + [(step, step + self.steps)]

    def wants(self, step: int) -> bool:
        """Whether :meth:`tick` of ``step`` would record or check anything: a loop may skip reading its metrics (a
        device sync) for the other steps."""
        return bool(self.on) and (self._checking is not None or any(a < step <= b for a, b in self._windows))

    def tick(self, step: int, metrics: dict[str, Any] | None) -> None:
        """The loop reached ``step`` and reported ``metrics``: recorded in a window, checked after a resume."""
        if not self.on or not metrics:
            return
        values = {}
        for name in AUDITED:
            if name in metrics:
                try:
                    values[name] = encode(float(metrics[name]))
                except (TypeError, ValueError):
                    continue
        if not values:
            return
        if self._checking is not None:
            self._check(step, values)
        ends = [end for start, end in self._windows if start < step <= end]
        if ends:  # written with the last step of a window: once a window, whatever the windows overlap
            self.record.add("metrics", lazy=step not in ends, background=True, step=step, **values)
            self._windows = [w for w in self._windows if w[1] > step]

    # ------------------------------------------------------------------------------------------- the run that resumes
    def restored(self, info: Any, causes: list[str] | None = None) -> None:
        """A restore of ``info.step``: the steps after it are compared with what the record holds of them.
        ``causes``: what the caller knows was not resumed (names of :data:`CAUSES`); by default what the manager's
        tracked states and ``info`` say."""
        self._windows = []
        if not self.on:
            return
        s, expected = info.step, {}
        for event in self.record.events:
            if event["kind"] == "metrics" and s < event.get("step", -1) <= s + self.steps:
                expected[event["step"]] = {k: event[k] for k in AUDITED if k in event}  # the newest wins
        self._checking = {"from": s, "expected": expected, "checked": 0, "differs": False,
                          "causes": self._causes(info) if causes is None else list(causes)}

    def _check(self, step: int, values: dict[str, Any]) -> None:
        state = self._checking
        assert state is not None
        s, expected = state["from"], state["expected"]
        if not expected and not state["checked"]:
            self._checking = None
            self.log.info("Resume audit from step %d: nothing recorded of the steps after it to compare (the run "
                          "that stopped reported no metrics there, or ended before it wrote them)", s)
            return
        was: dict[str, Any] = expected.pop(step, {}) if step <= s + self.steps else {}
        shared = [k for k in AUDITED if k in was and k in values]
        if shared:
            state["checked"] += 1
            if any(not _same(was[k], values[k]) for k in shared):
                if not all(_same(was[k], values[k]) or _close(was[k], values[k], self.tolerance) for k in shared):
                    return self._verdict("diverged", step, was, values)
                state["differs"] = True
        if not expected or step >= s + self.steps:
            if state["checked"]:
                return self._verdict("tolerance" if state["differs"] else "exact", None, None, None)
            self._checking = None

    def finish(self) -> None:
        """The run ends (its manager is closed) within the steps to check: the verdict on those compared."""
        state = self._checking
        if state is not None and state["checked"]:
            self._verdict("tolerance" if state["differs"] else "exact", None, None, None)
        self._checking = None

    def _verdict(self, verdict: str, at: int | None, was: dict[str, Any] | None, now: dict[str, Any] | None) -> None:
        state, self._checking = self._checking, None
        assert state is not None
        causes = [c for c in state["causes"] if not (c == "lr_scheduler" and was and now and "lr" in was
                                                     and "lr" in now and _same(was["lr"], now["lr"]))]
        values: dict[str, Any] = {"step": state["from"], "verdict": verdict, "checked": state["checked"]}
        if self.tolerance:
            values["tolerance"] = self.tolerance
        if verdict == "diverged":
            values.update(at=at, causes=causes, **{k: v for k, v in (now or {}).items()},
                          **{f"{k}_was": v for k, v in (was or {}).items()})
        self.emit("audit", begin=False, **values)
        line = describe({"kind": "audit", **values})
        (self.log.warning if verdict == "diverged" else self.log.info)("%s", line)

    def _causes(self, info: Any) -> list[str]:
        """What ckptio can see that makes a resumed run differ from the one that stopped."""
        from .. import _dist
        objects = self.tracked.objects
        causes = []
        if "dataloader" not in objects and not any("loader" in type(o).__name__.lower() for o in objects.values()):
            causes.append("dataloader")
        if "lr_scheduler" not in objects and not any("scheduler" in type(o).__name__.lower() and
                                                     hasattr(o, "get_last_lr") for o in objects.values()):
            causes.append("lr_scheduler")
        if "rng" not in objects and not any(type(o).__name__ == "RNGState" for o in objects.values()):
            causes.append("rng")
        if info.saved_world_size and info.saved_world_size != _dist.world_size():
            causes.append("ranks")
        report = info.report
        if report is not None:
            if report.cast or any(a.split()[-1:] != b.split()[-1:] for _, a, b in report.mismatched):
                causes.append("dtype")
            if report.excluded or report.missing:
                causes.append("load_exclude")
            if report.skipped_states:
                causes.append("load_states")
        return causes


def describe(event: dict[str, Any]) -> str:
    """The one line an ``audit`` event says (the log and ``ckptio report``)."""
    s, checked = event.get("step", "?"), event.get("checked", 0)
    head = f"Resume audit from step {s}: "
    if event.get("verdict") == "exact":
        return head + f"exact: the {checked} step(s) compared match the run that stopped bitwise"
    if event.get("verdict") == "tolerance":
        return head + (f"within the tolerance {event.get('tolerance', 0):g}: the {checked} step(s) compared match "
                       f"the run that stopped, not bitwise")
    shown = ", ".join(f"{k} {_fmt(event[k])} now vs {_fmt(event[k + '_was'])} recorded" for k in AUDITED
                      if k in event and k + "_was" in event)
    causes = event.get("causes") or []
    said = "; ".join(CAUSES.get(c, c) for c in causes) if causes else \
        "none that ckptio can see (a state registered under another name, a change of code, data or kernels?)"
    return head + f"DIVERGED at step {event.get('at', '?')}: {shown}; likely causes: {said}"


def _fmt(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.8g}"
