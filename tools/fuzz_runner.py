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
import os
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


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: descriptors are not counted
        return 0


def _worker(conn: Any, family: str, fn: Callable, indices: list[int], seed: int, root: Path, rss_mb: int,
            deadline: float | None, fd_bound: int) -> None:
    import logging

    logging.getLogger("ckptio").setLevel(logging.CRITICAL)
    if hasattr(fn, "own_dirs"):
        with contextlib.redirect_stdout(io.StringIO()):
            fn.own_dirs()  # the folders a family reuses, private to this worker: workers run side by side
    warm = Case("warm-up", pristine=True)
    outcome, detail = _one(family, fn, warm, root)
    base, base_fds = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _open_fds()
    conn.send(("ready", outcome, detail, base))
    bound = base + rss_mb * 1024
    for i in indices:
        if deadline is not None and time.monotonic() > deadline:
            break
        conn.send(("start", i))
        rng = Case(f"{family}-{case_seed(seed, i)}")
        rng.conn = conn
        outcome, detail = _one(family, fn, rng, root)
        rss, fds = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _open_fds()
        if rss > bound:
            outcome, detail = "other", f"peak RSS {rss >> 10} MiB, {(rss - base) >> 10} MiB above the worker's " \
                                       f"baseline (bound {rss_mb} MiB); " + detail
        elif fds > base_fds + fd_bound:
            outcome, detail = "other", f"descriptor leak: {fds - base_fds} more open descriptors than after the " \
                                       f"warm-up input (bound {fd_bound}); " + detail
        conn.send(("done", i, outcome, detail, rng.notes, rss))
        if rss > bound or fds > base_fds + fd_bound:
            return  # ru_maxrss never falls (and leaked descriptors stay): a fresh worker measures the next inputs
    conn.send(("end",))


PROGRESS_EVERY_S = 60.0


class _Tally(dict):
    """``{"ok", "clean", "other", "harness", "rss_kb", "seconds", "prepare_s", "failures": [(index, detail,
    notes)]}``."""

    def __init__(self) -> None:
        super().__init__(ok=0, clean=0, other=0, harness=0, rss_kb=0, seconds=0.0, prepare_s=0.0, failures=[])

    def fail(self, family: str, seed: int, i: int, detail: str, notes: list[str], verbose: bool) -> None:
        self["other"] += 1
        self["failures"].append((i, detail, notes))
        if verbose:
            print(f"  FAIL {family} seed={seed} input={i}: {detail}\n       input: {'; '.join(notes)}", flush=True)


class _Slot:
    """One worker process and the inputs left to it; replaced by a fresh one after a hang, a crash or a bound."""

    def __init__(self, run: "_Run", pending: list[int]) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self.run, self.pending = run, pending
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, run.family, run.fn, list(pending), run.seed, run.root,
                                                      run.rss_mb, run.deadline, run.fd_bound), daemon=True)
        self.proc.start()
        child.close()
        self.current: int | None = None
        self.notes: list[str] = []
        self.progressed = False
        self.until = time.monotonic() + run.warmup_timeout

    def handle(self, msg: tuple) -> bool:
        """Take one message; False once the worker said it is done."""
        run = self.run
        if msg[0] == "ready":
            if msg[1] == "other" and hasattr(run.fn, "prepare"):
                raise RuntimeError(f"{run.family}: the unmutated warm-up input failed: {msg[2]}")
        elif msg[0] == "start":
            self.current, self.notes = msg[1], []
        elif msg[0] == "note":
            self.notes.append(msg[1])
        elif msg[0] == "done":
            _, i, outcome, detail, notes, rss = msg
            run.tally["rss_kb"] = max(run.tally["rss_kb"], rss)
            if outcome == "other":
                run.tally.fail(run.family, run.seed, i, detail, notes, run.verbose)
            else:
                run.tally[outcome] += 1
                if outcome == "harness" and run.verbose:
                    print(f"  HARNESS ERROR {run.family} input={i}: {detail}", flush=True)
            self.pending.remove(i)
            self.current, self.progressed = None, True
            run.progress()
        elif msg[0] == "end":
            return False
        self.until = time.monotonic() + run.timeout
        return True

    def finish(self, why: str) -> None:
        """The worker ended (``why`` is empty), hung or died: reap it; the input it was on is a failure."""
        if why:
            self.proc.kill()
        self.proc.join()
        self.conn.close()
        run = self.run
        if self.current is not None:
            exit_code = f" (exit code {self.proc.exitcode})" if why == "the worker died" else ""
            run.tally.fail(run.family, run.seed, self.current, why + exit_code, self.notes, run.verbose)
            self.pending.remove(self.current)
        elif self.pending and not self.progressed and not run.over():
            raise RuntimeError(f"{run.family}: the worker stopped before any input (exit code {self.proc.exitcode})")


class _Run:
    """The settings of one family's run, shared by its worker slots."""

    def __init__(self, family: str, fn: Callable, seed: int, root: Path, tally: _Tally, **opts: Any) -> None:
        self.family, self.fn, self.seed, self.root, self.tally = family, fn, seed, root, tally
        self.timeout, self.rss_mb, self.verbose = opts["timeout"], opts["rss_mb"], opts["verbose"]
        self.warmup_timeout, self.deadline, self.fd_bound = opts["warmup_timeout"], opts["deadline"], opts["fd_bound"]
        self._began = self._said = time.monotonic()

    def over(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def progress(self) -> None:
        """A line a minute on a long run: inputs done, their rate, the tally so far."""
        now = time.monotonic()
        if not self.verbose or now - self._said < PROGRESS_EVERY_S:
            return
        t = self.tally
        done = t["ok"] + t["clean"] + t["other"] + t["harness"]
        print(f"  {self.family}: {done} inputs in {now - self._began:.0f} s ({done / (now - self._began):.1f}/s): "
              f"{t['ok']} loaded right, {t['clean']} clean errors, {t['other']} failures", flush=True)
        self._said = now


def _supervise(run: _Run, shares: list[list[int]]) -> None:
    """Workers over ``shares`` (one list of inputs each) side by side, each replaced after a hang or a death until
    its inputs are done (or the time budget is spent)."""
    from multiprocessing.connection import wait

    slots = {id(s): s for s in (_Slot(run, share) for share in shares if share)}
    while slots:
        now = time.monotonic()
        ready = wait([s.conn for s in slots.values()], timeout=max(0.0, min(s.until for s in slots.values()) - now))
        for slot in list(slots.values()):
            why = None
            if slot.conn in ready:
                try:
                    while why is None and slot.conn.poll():
                        why = None if slot.handle(slot.conn.recv()) else ""
                except EOFError:
                    why = "the worker died" if slot.current is not None else ""
            elif time.monotonic() > slot.until:
                why = f"no answer within {run.timeout if slot.progressed else run.warmup_timeout:.0f} s (a hang)"
            if why is not None:
                slot.finish(why)
                del slots[id(slot)]
                if slot.pending and not run.over():
                    fresh = _Slot(run, slot.pending)
                    slots[id(fresh)] = fresh


def run_family(family: str, fn: Callable[[Case, Path], None], indices: list[int], seed: int, *, timeout: float = 10.0,
               rss_mb: int = 256, verbose: bool = True, warmup_timeout: float = 300.0, jobs: int = 1,
               minutes: float | None = None, fd_bound: int = 256) -> dict[str, Any]:
    """Try the inputs ``indices`` of ``family`` in ``jobs`` worker processes side by side, a new one after each
    that hangs, dies or passes the RSS or descriptor bound, stopping early once ``minutes`` (counted after the
    family's preparation) are spent; returns the tally (see :class:`_Tally`; ``seconds`` is the time spent on the
    inputs, ``prepare_s`` the preparation before them)."""
    tally = _Tally()
    start = time.perf_counter()
    for size in BOMB_SIZES:
        _deflated_zeros(size)  # made here once: deflating them inside an input would count against its time
    if hasattr(fn, "prepare"):
        with contextlib.redirect_stdout(io.StringIO()):
            fn.prepare()  # the valid folders, built once here: every worker forked after inherits them
    tally["prepare_s"] = time.perf_counter() - start
    start = time.perf_counter()
    deadline = time.monotonic() + minutes * 60 if minutes else None
    root = scratch_root()
    jobs = max(1, jobs)
    try:
        run = _Run(family, fn, seed, root, tally, timeout=timeout, rss_mb=rss_mb, verbose=verbose,
                   warmup_timeout=warmup_timeout, deadline=deadline, fd_bound=fd_bound)
        _supervise(run, [list(indices[j::jobs]) for j in range(jobs)])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tally["seconds"] = time.perf_counter() - start
    return tally


def summary_line(family: str, counts: dict[str, Any], rss_mb: int) -> str:
    """The one line that ends a family's run: its tally, peak RSS and inputs per second."""
    n = counts["ok"] + counts["clean"] + counts["other"] + counts["harness"]
    return (f"{family:<12} {n:>7} inputs  loaded right {counts['ok']:>7}  clean errors {counts['clean']:>7}  "
            f"failures {counts['other']:>4}  peak RSS {counts['rss_kb'] >> 10:>5} MiB (bound: baseline + {rss_mb} "
            f"MiB)  {n / max(counts['seconds'], 1e-9):.1f} inputs/s ({counts['seconds']:.1f} s, after "
            f"{counts['prepare_s']:.1f} s of preparation)"
            + (f"  HARNESS ERRORS {counts['harness']}" if counts["harness"] else ""))


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
