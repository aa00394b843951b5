"""The fuzzer's runner: each family's inputs in a forked worker process, under a time limit and a bound on peak
memory.

The worker reports the start, the notes and the end of each input over a pipe; the parent kills it when an input
runs longer than the time limit (a hang, even inside C code), or finds it dead (a crash), records that input as
a failure with its notes and starts a new worker after it. Peak RSS is the worker's ``ru_maxrss``: an input after
which it exceeds the worker's own baseline (measured after one valid input) by more than the bound is a failure,
and the worker is replaced so the next inputs are measured afresh.
"""

from __future__ import annotations

import contextlib
import io
import re
import resource
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from fuzz_kit import Case, WrongResult, case_seed, check_no_code_ran, scratch_root
from fuzz_mutations import BOMB_SIZES, _deflated_zeros

from ckptio import CheckpointError  # noqa: E402


def _one(family: str, fn: Callable[[Case, Path], None], rng: Case, root: Path) -> tuple[str, str]:
    tmp = Path(tempfile.mkdtemp(dir=root))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            fn(rng, tmp)
        check_no_code_ran(tmp)
        return "ok", ""
    except CheckpointError as exc:
        try:
            check_no_code_ran(tmp)
        except WrongResult as wrong:
            return "other", f"WrongResult: {wrong}"
        return "clean", f"{type(exc).__name__}: {str(exc)[:160]}"
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every other outcome is a finding
        tb = traceback.extract_tb(exc.__traceback__)
        if rng.reading is False:
            return "harness", f"HARNESS {type(exc).__name__}: {exc}; " + "".join(traceback.format_tb(exc.__traceback__))
        ours = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "/src/ckptio/" in f.filename), None)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        where += f" (from ckptio {ours})" if ours and not tb[-1].filename.endswith(ours.split(":")[0]) else ""
        return "other", f"{type(exc).__name__} at {where}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _worker(conn: Any, family: str, fn: Callable, indices: list[int], seed: int, root: Path, rss_mb: int) -> None:
    import logging

    logging.getLogger("ckptio").setLevel(logging.CRITICAL)
    warm = Case("warm-up", pristine=True)
    outcome, detail = _one(family, fn, warm, root)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    conn.send(("ready", outcome, detail, base))
    bound = base + rss_mb * 1024
    for i in indices:
        conn.send(("start", i))
        rng = Case(f"{family}-{case_seed(seed, i)}")
        rng.conn = conn
        outcome, detail = _one(family, fn, rng, root)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if rss > bound:
            outcome, detail = "other", f"peak RSS {rss >> 10} MiB, {(rss - base) >> 10} MiB above the worker's " \
                                       f"baseline (bound {rss_mb} MiB); " + detail
        conn.send(("done", i, outcome, detail, rng.notes, rss))
        if rss > bound:
            return  # ru_maxrss never falls: a fresh worker measures the next inputs
    conn.send(("end",))


class _Tally(dict):
    """``{"ok", "clean", "other", "harness", "rss_kb", "seconds", "failures": [(index, detail, notes)]}``."""

    def __init__(self) -> None:
        super().__init__(ok=0, clean=0, other=0, harness=0, rss_kb=0, seconds=0.0, failures=[])

    def fail(self, family: str, seed: int, i: int, detail: str, notes: list[str], verbose: bool) -> None:
        self["other"] += 1
        self["failures"].append((i, detail, notes))
        if verbose:
            print(f"  FAIL {family} seed={seed} input={i}: {detail}\n       input: {'; '.join(notes)}", flush=True)


def _supervise(family: str, fn: Callable, pending: list[int], seed: int, root: Path, tally: _Tally, *, timeout: float,
               rss_mb: int, verbose: bool, warmup_timeout: float) -> None:
    """One worker over ``pending`` (the inputs done are removed from it) until it ends, hangs or dies; an input it
    was on then is a failure."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, family, fn, list(pending), seed, root, rss_mb), daemon=True)
    proc.start()
    child.close()
    current, notes, progressed, waited, why = None, [], False, warmup_timeout, ""
    while True:
        if not parent.poll(waited):
            proc.kill()
            why = f"no answer within {waited:.0f} s (a hang)"
            break
        try:
            msg = parent.recv()
        except EOFError:
            why = "the worker died" if current is not None else ""
            break
        if msg[0] == "ready":
            if msg[1] == "other" and hasattr(fn, "prepare"):
                raise RuntimeError(f"{family}: the unmutated warm-up input failed: {msg[2]}")
            waited = timeout
        elif msg[0] == "start":
            current, notes = msg[1], []
        elif msg[0] == "note":
            notes.append(msg[1])
        elif msg[0] == "done":
            _, i, outcome, detail, notes, rss = msg
            tally["rss_kb"] = max(tally["rss_kb"], rss)
            if outcome == "other":
                tally.fail(family, seed, i, detail, notes, verbose)
            else:
                tally[outcome] += 1
                if outcome == "harness" and verbose:
                    print(f"  HARNESS ERROR {family} input={i}: {detail}", flush=True)
            pending.remove(i)
            current, progressed = None, True
        elif msg[0] == "end":
            break
    proc.join()
    parent.close()
    if current is not None:
        exit_code = f" (exit code {proc.exitcode})" if why == "the worker died" else ""
        tally.fail(family, seed, current, why + exit_code, notes, verbose)
        pending.remove(current)
    elif pending and not progressed:
        raise RuntimeError(f"{family}: the worker stopped before any input (exit code {proc.exitcode})")


def run_family(family: str, fn: Callable[[Case, Path], None], indices: list[int], seed: int, *, timeout: float = 10.0,
               rss_mb: int = 256, verbose: bool = True, warmup_timeout: float = 300.0) -> dict[str, Any]:
    """Try the inputs ``indices`` of ``family`` in worker processes, a new one after each that hangs, dies or
    passes the RSS bound; returns the tally (see :class:`_Tally`)."""
    tally = _Tally()
    pending = list(indices)
    start = time.perf_counter()
    for size in BOMB_SIZES:
        _deflated_zeros(size)  # made here once: deflating them inside an input would count against its time
    if hasattr(fn, "prepare"):
        with contextlib.redirect_stdout(io.StringIO()):
            fn.prepare()  # the valid folders, built once here: every worker forked after inherits them
    root = scratch_root()
    try:
        while pending:
            _supervise(family, fn, pending, seed, root, tally, timeout=timeout, rss_mb=rss_mb, verbose=verbose,
                       warmup_timeout=warmup_timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tally["seconds"] = time.perf_counter() - start
    return tally


def distinct(failures: list[tuple[int, str, list[str]]]) -> dict[str, tuple[int, int, list[str]]]:
    """The failures grouped by what went wrong (the exception and where, paths and numbers left out), each with the
    input that shows it with the fewest changes."""
    groups: dict[str, tuple[int, int, list[str]]] = {}
    for i, detail, notes in failures:
        head = detail.split("; CheckpointCorruptError")[0] if detail.startswith("peak RSS") else detail
        sig = re.sub(r"\d+", "N", re.sub(r"/\S+", "<path>", head))[:140]
        n, best, best_notes = groups.get(sig, (0, i, notes))
        if len(notes) < len(best_notes):  # the input with the fewest changes: the shortest reproducer
            best, best_notes = i, notes
        groups[sig] = (n + 1, best, best_notes)
    return dict(sorted(groups.items(), key=lambda kv: -kv[1][0]))


def debug(families: dict[str, Callable], indices: list[int], seed: int) -> int:
    """Run the inputs ``indices`` of ``families`` here, printing what was done to each and its full traceback."""
    for family, fn in families.items():
        if hasattr(fn, "prepare"):
            fn.prepare()
        for i in indices:
            rng = Case(f"{family}-{case_seed(seed, i)}")
            tmp = scratch_root()
            print(f"--- {family} input {i} in {tmp}")
            try:
                fn(rng, tmp)
                print("returned (loaded right)")
            except BaseException as exc:  # noqa: BLE001 - shown, whatever it is
                traceback.print_exc()
                print(f"raised {type(exc).__name__}")
            print("input: " + "; ".join(rng.notes))
    return 0
