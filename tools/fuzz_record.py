"""The fuzz family of the run's record (``.ckptio_record.json``, issue 49), run by ``fuzz_readers.py``:

  record       the run's record with fields of other types, huge, negative and non-finite numbers, unknown kinds and
               fields, the resume audit's values (non-finite ones as text) and verdicts with their causes, deep
               nesting, too many events, byte damage and truncation, and the record as a link (to a file outside), a
               folder, a FIFO or a huge sparse file

Each input: a manager's record is opened over it (``RunRecord``, what every ``CheckpointManager`` does at start),
which must never raise (a refused record is moved aside, its bytes kept, and a new one begins); then the gate's
parse of the same bytes must give back exactly the events written, or a ckptio error (``clean``); an accepted
record is then summed up and drawn as ``ckptio report`` does (terminal text, JSON and page), and its numbers go
to the ``"auto"`` interval chooser as a restarted run's would (:func:`_plan`): neither may raise, every number
they give must be finite and every interval within its bounds. The accepted records include the numbers that once
broke them: denormal, huge and zero times and durations, events stamped in the future or before the record's
start, and starts at one instant (zero-length processes).
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

from fuzz_kit import WrongResult, flip

_VALUES = [None, True, -1, 0, 1.5, float("nan"), 1e308, 10**400, "", "x" * 300, [], {}, [[[[]]]], "durable", "s3"]
_METRIC_VALUES = [2.5, -1e308, 5e-324, 0, "nan", "inf", "-inf", 1e308]
"""What a loop may report of a step (the resume audit): non-finite values are kept as text."""
_EDGE_TIMES = [0.0, 5e-324, 2.2e-308, 1e-9, 1e12, 1e12 - 1e-3]
"""Times and durations a record passes its checks with that once overflowed or divided by zero downstream."""


def _edges(rng: random.Random, events: list[dict]) -> list[dict]:
    """``events`` with edge numbers: denormal, huge or zero times and durations, stamps in the future (minutes or
    years ahead of now) or before the record's start, and starts at one instant."""
    import time

    now = time.time()
    how = rng.choice(["times", "future", "past", "instant", "durations"])
    if how == "times":
        for event in events:
            event["time"] = rng.choice(_EDGE_TIMES)
    elif how == "future":
        for event in rng.sample(events, rng.randint(1, len(events))):
            event["time"] = now + rng.choice([0.5, 250.0, 1e6, 1e12 - now])
    elif how == "past":
        events.insert(0, {"kind": "start", "time": now - 100})
        events.append({"kind": rng.choice(["start", "progress", "save"]), "time": rng.choice([0.0, 5.0, now - 200])})
        events.append({"kind": "progress", "time": now - 1, "step": 5})
    elif how == "instant":
        same = rng.choice(_EDGE_TIMES + [now - 60])
        events[:] = [dict(e, time=same) for e in events] + [{"kind": "start", "time": same}] * rng.randint(1, 3)
    for event in events:
        for name in ("blocked_s", "total_s", "restore_s", "startup_s", "age_s"):
            if name in event or how == "durations" and event["kind"] == "save" and name in ("blocked_s", "total_s"):
                event[name] = rng.choice(_EDGE_TIMES + [0.25])
    return events


def _events(rng: random.Random) -> list[dict]:
    events: list[dict] = [{"kind": "start", "time": 1000.0, "ranks": 2}]
    for i in range(rng.randint(0, 8)):
        events.append({"kind": "save", "time": 1001.0 + i, "step": 10 * i, "tier": rng.choice(["durable", "memory"]),
                       "blocked_s": 0.25, "total_s": 1.5, "bytes": 1 << 20, "files": 3, "storage": "local",
                       "ranks": 2})
    if rng.random() < 0.5:  # a restart, what the report draws
        events += [{"kind": "start", "time": 1500.0 + rng.random(), "ranks": 2},
                   {"kind": "restore", "time": rng.choice([1501.0, 900.0, 0.0]), "step": 10, "tier": "memory",
                    "steps_lost": rng.choice([0, 3, 1 << 62]), "restore_s": 0.5, "startup_s": 4.0},
                   {"kind": "remove", "time": 1502.0, "step": 0}, {"kind": "remove", "time": 1502.5}]
    if rng.random() < 0.3:  # saves that failed while training went on (failed_saves_allowed)
        events += [{"kind": "save_failed", "time": 1503.0, "tier": rng.choice(["durable", "memory"]), "step": 20},
                   {"kind": "save_failed", "time": 1504.0, "tier": "durable"}]
    if rng.random() < 0.5:  # the resume audit: the steps after a save, and a verdict on a resume
        events += [{"kind": "metrics", "time": 1505.0 + i, "step": 11 + i, "loss": rng.choice(_METRIC_VALUES),
                    "grad_norm": rng.choice(_METRIC_VALUES), "lr": 1e-4} for i in range(rng.randint(1, 3))]
        events.append({"kind": "audit", "time": 1510.0, "step": 10, "checked": rng.randint(0, 3),
                       **rng.choice([{"verdict": "exact"}, {"verdict": "tolerance", "tolerance": 1e-3},
                                     {"verdict": "diverged", "at": 11, "causes": ["dataloader", "rng", "ranks"],
                                      "loss": rng.choice(_METRIC_VALUES), "loss_was": rng.choice(_METRIC_VALUES),
                                      "lr": 1e-4, "lr_was": 2e-4}])})
    events.append(rng.choice([{"kind": "end", "time": 2000.0}, {"kind": "progress", "time": 2000.0, "step": 99}]))
    return events


def _damage(rng: random.Random, events: list[dict]) -> bytes:
    how = rng.choice(["value", "value", "drop", "add", "kind", "deep", "many", "flip", "cut", "other"])
    doc: dict = {"format": "ckptio-record", "version": 1, "events": events}
    event = rng.choice(events)
    if how == "value":
        event[rng.choice(sorted(event))] = rng.choice(_VALUES)
    elif how == "drop":
        event.pop(rng.choice(sorted(event)))
    elif how == "add":
        event[rng.choice(["extra", "step", "bytes", "__class__"])] = rng.choice(_VALUES)
    elif how == "kind":
        event["kind"] = rng.choice(["restart", "", "save ", 7])
    elif how == "deep":
        nested: object = 1
        for _ in range(rng.choice([70, 5000])):
            nested = [nested]
        event["step"] = nested
    elif how == "many":
        doc["events"] = events * (5000 // len(events) + 1)
    elif how == "other":
        doc = rng.choice([{"format": "x", "version": 1, "events": []}, {"format": "ckptio-record", "version": 2},
                          {"events": "no"}, []])  # type: ignore[assignment]
    data = json.dumps(doc, allow_nan=True, default=str).encode() if how != "deep" else _deep_json(doc)
    if how == "flip":
        data = flip(rng, data)
    elif how == "cut":
        data = data[: rng.randint(0, len(data))]
    return data


def _deep_json(doc: dict) -> bytes:
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)
    try:
        return json.dumps(doc).encode()
    finally:
        sys.setrecursionlimit(limit)


def fuzz_record(rng: random.Random, tmp: Path) -> None:
    from ckptio.goodput.record import RECORD_NAME, RunRecord, dump, parse
    from ckptio.storage import open_storage

    root = tmp / "run"
    root.mkdir()
    outside = tmp / "outside"
    outside.mkdir()
    canary = outside / "secret.json"
    canary.write_bytes(dump(_events(rng)))
    before = canary.read_bytes()
    events = _events(rng)
    target = root / RECORD_NAME
    form = rng.choice(["file"] * 6 + ["link", "folder", "fifo", "sparse"])
    written, size = b"", 0
    if form == "file":
        pick = rng.random()
        written = dump(events) if pick < 0.15 else dump(_edges(rng, events)) if pick < 0.45 else _damage(rng, events)
        target.write_bytes(written)
    elif form == "link":
        os.symlink(canary, target)
    elif form == "folder":
        target.mkdir()
    elif form == "fifo":
        os.mkfifo(target)
    else:
        size = rng.choice([5 << 20, 1 << 33])
        with open(target, "wb") as fh:
            fh.truncate(size)
    log = logging.getLogger("ckptio.fuzz.record")
    log.disabled = True
    record = RunRecord(open_storage(root), writer=True, log=log)  # never raises: a refused record is set aside
    record.begin()
    record.add("save", step=1, tier="durable", blocked_s=0.1)
    if canary.read_bytes() != before:
        raise WrongResult("the file outside the folder was changed")
    aside = [p for p in root.iterdir() if p.name.startswith(f"{RECORD_NAME}.damaged-")]
    if form == "file" and aside and aside[0].read_bytes() != written:
        raise WrongResult("the refused record was not kept as it was")
    if form == "file" and not aside and record.events[:-1] != parse(written, target):
        raise WrongResult("the record read back differs from the one written")
    if form == "sparse" and size == 1 << 33 and target.stat().st_size != size:
        raise WrongResult("a record too large to keep aside was replaced")
    if form != "file":
        return
    got = parse(written, target)  # clean (a CheckpointError) or right
    if got != [_typed(e) for e in json.loads(written)["events"]]:
        raise WrongResult(f"parsed {got[:2]} from {written[:200]!r}")
    _report(got, root, tmp)


def _report(events: list[dict], root: Path, tmp: Path) -> None:
    """What ``ckptio report`` makes of an accepted record: the summary, the terminal text, the JSON and the page,
    built without an error, with a goodput in [0, 1], every number finite, and the page's data as JSON; then the
    record's numbers through the interval chooser (:func:`_plan`)."""
    from ckptio.cli.report_cmd import _as_json, text
    from ckptio.goodput.report_html import render
    from ckptio.goodput.summary import summarize

    summary = summarize(events)
    if summary.goodput is not None and not 0 <= summary.goodput <= 1:
        raise WrongResult(f"goodput {summary.goodput}")
    for rate in (None, 1e9, 5e-324):
        shown = "\n".join(line for line in text(summary, str(root), rate).splitlines()
                           if not line.startswith("  Resume audit"))  # the loop's own values, nan included
        shown = shown.replace(str(root), "<folder>")  # a random folder name may hold "inf" (tmp9infxbwm did)
        if "inf" in shown.lower() or "nan" in shown.lower():
            raise WrongResult(f"a number the report shows is not finite: {shown[:600]}")
        json.dumps(_as_json(summary, rate), allow_nan=False)  # ValueError (not a ckptio error) on inf or nan
    page = render(summary, str(root), 1e9)
    data = page.split('<script type="application/json" id="data">', 1)[1].split("</script>", 1)[0]
    json.loads(data)
    (tmp / "page.html").write_text(page)
    _plan(root)


def _plan(root: Path) -> None:
    """The ``"auto"`` intervals a restarted run chooses from this record (both tiers, each alone; step times from
    denormal to huge): a number of steps in [1, 10**12] each, the durable one a multiple of the memory one."""
    import time

    from ckptio.goodput import _memory_share
    from ckptio.goodput.interval import MAX_STEPS, IntervalPlanner, plan_two_tiers
    from ckptio.goodput.record import RunRecord
    from ckptio.storage import open_storage

    log = logging.getLogger("ckptio.fuzz.record")
    record = RunRecord(open_storage(root), writer=False, log=log)
    record.add("start", ranks=1)  # what the restarted process's manager records first
    failures, up = record.failures()
    if not 0 <= up <= max(0.0, time.time() + 2 - min(e["time"] for e in record.events)):
        raise WrongResult(f"{up} s of uptime from a record that spans less")
    learned = record.learned_mtbf()
    for step_s in (5e-324, 1e-9, 0.5, 1e12):
        planners = {}
        for tier in ("memory", "durable"):
            planner = IntervalPlanner(tier, mtbf_s=None, learned_mtbf_s=learned, learned_failures=failures,
                                      first_cost_s=0.01, log=log)
            planner.costs.extend(e["blocked_s"] for e in record.saves(tier)[-20:] if "blocked_s" in e)
            planner.step_times.extend([step_s] * 3)
            every = planner.choice()
            if not (isinstance(every, int) and 1 <= every <= MAX_STEPS):
                raise WrongResult(f"the {tier} interval is {every} steps ({planner.reason})")
            planners[tier] = planner
        mem, dur = plan_two_tiers(planners["memory"], planners["durable"], *_memory_share(None, record))
        if not (1 <= mem <= dur <= MAX_STEPS and dur % mem == 0):
            raise WrongResult(f"both tiers: every {mem} and {dur} steps ({planners['durable'].reason})")


def _typed(event: dict) -> dict:
    numbers = ("time", "blocked_s", "total_s", "restore_s", "startup_s", "age_s", "tolerance")
    metrics = ("loss", "grad_norm", "lr", "loss_was", "grad_norm_was", "lr_was")
    return {k: float(v) if k in numbers or k in metrics and not isinstance(v, str) else v for k, v in event.items()}
