"""The fuzz family of the run's record (``.ckptio_record.json``, issue 49), run by ``fuzz_readers.py``:

  record       the run's record with fields of other types, huge, negative and non-finite numbers, unknown kinds and
               fields, deep nesting, too many events, byte damage and truncation, and the record as a link (to a
               file outside), a folder, a FIFO or a huge sparse file

Each input: a manager's record is opened over it (``RunRecord``, what every ``CheckpointManager`` does at start),
which must never raise (a refused record is moved aside, its bytes kept, and a new one begins); then the gate's
parse of the same bytes must give back exactly the events written, or a ckptio error (``clean``); an accepted
record is then summed up and drawn as ``ckptio report`` does (terminal text and page), which must not raise.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

from fuzz_kit import WrongResult, flip

_VALUES = [None, True, -1, 0, 1.5, float("nan"), 1e308, 10**400, "", "x" * 300, [], {}, [[[[]]]], "durable", "s3"]


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
        written = dump(events) if rng.random() < 0.15 else _damage(rng, events)
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
    """What ``ckptio report`` makes of an accepted record: the summary, the terminal text and the page, built without
    an error, with a goodput in [0, 1] and the page's data as JSON."""
    from ckptio.cli.report_cmd import text
    from ckptio.goodput.report_html import render
    from ckptio.goodput.summary import summarize

    summary = summarize(events)
    if summary.goodput is not None and not 0 <= summary.goodput <= 1:
        raise WrongResult(f"goodput {summary.goodput}")
    text(summary, str(root), 1e9)
    page = render(summary, str(root), 1e9)
    data = page.split('<script type="application/json" id="data">', 1)[1].split("</script>", 1)[0]
    json.loads(data)
    (tmp / "page.html").write_text(page)


def _typed(event: dict) -> dict:
    numbers = ("time", "blocked_s", "total_s", "restore_s", "startup_s")
    return {k: float(v) if k in numbers else v for k, v in event.items()}
