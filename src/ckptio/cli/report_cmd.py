"""``ckptio report RUN_DIR``: what checkpointing cost a run, from its record (``.ckptio_record.json``).

Prints the run's goodput, failures, saves (per tier: what the training loop waited, the whole save, bytes, against
the storage's write limit measured now), restores and what retention removed, and the interval the numbers call
for; ``--html FILE`` writes the same as one self-contained page with charts (``docs/goodput.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ._fmt import human_bytes, print_json, table

if TYPE_CHECKING:  # ckptio.goodput imports torch: only when the command runs (``--help`` stays light)
    from ..goodput.summary import Summary

_CHUNK = 8 << 20


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ckptio report``."""
    p = sub.add_parser("report", help="what checkpointing cost a run: goodput, saves, restores (--html: a page)",
                       description="Summarise a run's record of saves, restores and failures (.ckptio_record.json, "
                                   "written by CheckpointManager into its checkpoint_dir).")
    p.add_argument("run_dir", help="the run's checkpoint_dir (a folder or s3://bucket/prefix)")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained page with charts to FILE")
    p.add_argument("--probe-mib", type=int, default=128, metavar="MIB",
                   help="measure the storage's write limit by writing and fsyncing MIB MiB into RUN_DIR (removed "
                        "after; local folders only; 0: do not measure; default 128)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the summary of a run's record (and write its page with ``--html``)."""
    from ..goodput.record import MAX_RECORD_BYTES, RECORD_NAME
    from ..goodput.summary import load
    from ..storage import open_storage

    storage = open_storage(args.run_dir)
    folder, where = storage.folder(), f"{str(args.run_dir).rstrip('/')}/{RECORD_NAME}"
    if folder.kind(RECORD_NAME) != "file":
        raise CheckpointError(f"{where}: no run record (CheckpointManager writes it from a run's first save or "
                              f"restore, with run_record=True, the default)")
    summary = load(folder.read_bytes(RECORD_NAME, max_size=MAX_RECORD_BYTES), where)
    rate = None
    if args.probe_mib > 0 and isinstance(storage.root, Path):
        rate = probe_write_rate(storage.root, args.probe_mib)
    if args.json:
        print_json(_as_json(summary, rate))
    else:
        print(text(summary, where, rate))
    if args.html:
        from ..goodput.report_html import render

        Path(args.html).write_text(render(summary, where, rate), encoding="utf-8")
        print(f"\nWrote {args.html}", file=sys.stderr if args.json else sys.stdout)
    return 0


def probe_write_rate(root: Path, mib: int) -> float | None:
    """Bytes a second of writing ``mib`` MiB into ``root`` and fsyncing them (the file is removed after); ``None``
    when the folder cannot be written (a report on a read-only copy still works)."""
    probe = root / f".ckptio-report-probe-{os.getpid()}.tmp"
    block = os.urandom(_CHUNK)
    print(f"Measuring the storage's write limit: {mib} MiB into {root} (removed after)...", file=sys.stderr)
    try:
        start = time.perf_counter()
        with open(probe, "xb") as fh:
            for _ in range(max(1, (mib << 20) // _CHUNK)):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        return max(1, (mib << 20) // _CHUNK) * _CHUNK / (time.perf_counter() - start)
    except OSError as exc:
        print(f"Could not measure the storage ({exc}); the saves are shown without its limit", file=sys.stderr)
        return None
    finally:
        probe.unlink(missing_ok=True)


def suggested_every(summary: Summary, tier: str) -> tuple[int, str] | None:
    """The interval in steps the record's numbers call for (median blocked time of the tier's last 20 saves, the
    run's step time, its learned MTBF or one day) and why; ``None`` without a step time or a save."""
    from ..goodput.interval import daly_interval, span as _span, steps_for

    saves = [e["blocked_s"] for e in summary.saves[tier][-20:] if "blocked_s" in e]
    if not saves or not summary.step_s:
        return None
    cost, mtbf = statistics.median(saves), summary.mtbf_s or 86400.0
    every = steps_for(daly_interval(cost, mtbf), summary.step_s)
    source = "learned from its failures" if summary.mtbf_s else "assumed: no failure recorded"
    return every, (f"a save blocks {cost:.3g} s, a step takes {summary.step_s:.3g} s, one failure per "
                   f"{_span(mtbf)} ({source})")


def text(summary: Summary, where: str, rate: float | None) -> str:
    """The terminal summary."""
    from ..goodput.interval import span as _span

    good = "-" if summary.goodput is None else f"{100 * summary.goodput:.1f} %"
    lines = [f"Run record {where}", "",
             f"goodput (estimated)   {good} of {_span(summary.wall_s)} wall time, newest step "
             f"{summary.newest_step if summary.newest_step is not None else '-'}",
             f"  saves blocked       {_span(summary.blocked_s)}",
             f"  steps redone        {_span(summary.redone_s)}"
             + (f" (a step takes {summary.step_s:.3g} s)" if summary.step_s else "") + _unseen(summary),
             f"  restarting          {_span(summary.restarting_s)} (and the first start's set-up "
             f"{_span(summary.setup_s)}, not lost)",
             f"processes             {len(summary.processes)}, failures {summary.failures}"
             + (f", one per {_span(summary.mtbf_s)} of running" if summary.mtbf_s else ""),
             f"storage write limit   {human_bytes(int(rate)) + '/s' if rate else 'not measured'}", ""]
    rows = []
    for tier, saves in summary.saves.items():
        if saves:
            rows.append(_tier_row(tier, saves, rate))
    lines.append(table(rows, ["tier", "saves", "blocked (median / max)", "whole save (median)", "bytes (median)",
                              "at the limit"]) if rows else "No saves recorded.")
    for tier in summary.saves:
        choice = suggested_every(summary, tier)
        if choice is not None:
            lines.append(f"interval for the {tier} tier: every {choice[0]} steps: {choice[1]}")
    lines.append("")
    if summary.restores:
        lines.append(table([[str(e.get("step", "-")), e.get("tier", "-"), str(e.get("steps_lost", "-")),
                             _span(e.get("restore_s")), _span(e.get("startup_s"))] for e in summary.restores],
                           ["restored step", "tier", "steps lost", "restore", "start to first step"]))
    else:
        lines.append("No restore recorded.")
    if summary.audits:
        from ..goodput.audit import describe

        lines += ["Resume audits (each resume against what the run that stopped recorded of the same steps):"]
        lines += [f"  {describe(e)}" for e in summary.audits]
    removed = [str(e["step"]) for e in summary.removes if "step" in e]
    lines.append(f"Removed by retention: {len(summary.removes)} checkpoint(s)"
                 + (f" (steps {', '.join(removed[:12])}{', ...' if len(removed) > 12 else ''})" if removed else ""))
    failed = summary.failed_saves
    if failed:
        steps = [f"{e.get('tier', '?')} {e['step']}" if "step" in e else e.get("tier", "?") for e in failed]
        lines.append(f"Failed saves (training went on): {len(failed)} ({', '.join(steps[:12])}"
                     f"{', ...' if len(steps) > 12 else ''})")
    return "\n".join(lines)


def _unseen(summary: Summary) -> str:
    """What the steps redone may leave out: the unseen end of each failed process, and restores of unknown loss."""
    from ..goodput.record import PROGRESS_EVERY_S

    out = []
    if summary.unseen_s:
        steps = summary.unseen_steps
        out.append(f"up to {steps if steps is not None else 'an unknown number of'} step(s) more not seen: the record "
                   f"writes progress every {PROGRESS_EVERY_S:.0f} s, and the end of a failed process is not recorded")
    if summary.unknown_lost:
        out.append(f"not known for {summary.unknown_lost} restore(s) of which nothing before was recorded")
    return "; " + "; ".join(out) if out else ""


def _tier_row(tier: str, saves: list[dict[str, Any]], rate: float | None) -> list[str]:
    from ..goodput.interval import span as _span

    blocked = [e["blocked_s"] for e in saves if "blocked_s" in e]
    total = [e["total_s"] for e in saves if "total_s" in e]
    sizes = [e["bytes"] for e in saves if "bytes" in e]
    at_limit = "-"
    whole = statistics.median(total) if total else 0.0
    if rate and sizes and whole > 0:  # a save of 0 s (or a denormal time) has no speed to set against the limit
        share = statistics.median(sizes) / rate / whole
        at_limit = f"{share:.0%} of its speed" if share <= 100 else "over 100x its speed"
    return [tier, str(len(saves)),
            f"{_span(statistics.median(blocked))} / {_span(max(blocked))}" if blocked else "-",
            _span(statistics.median(total)) if total else "-",
            human_bytes(int(statistics.median(sizes))) if sizes else "-", at_limit]


def _as_json(summary: Summary, rate: float | None) -> dict[str, Any]:
    from ..goodput.report_html import page_data

    return page_data(summary, "", rate) | {"suggested": {tier: suggested_every(summary, tier)
                                                           for tier in summary.saves}}
