"""How often a finished job's ranks die at interpreter exit: with ckptio, and the same job without it.

    .venv/bin/python tools/exit_aborts.py --runs 100 [--variants ckptio,plain] [--load 1] [--cores 2]
        [--before-src OLD/src]

Each run is the job of ``tests/memory_node_worker.py`` on two ``torchrun`` "nodes" of 2 ranks each on 127.0.0.1
(FSDP2 tiny Llama, a memory-tier snapshot every 2 steps, a durable save every 10, 20 steps), ended as a user's
script ends it: ``close()``, ``destroy_process_group()``, return from ``main`` (no ``os._exit``), the manager still
referenced until the interpreter exits (as a script's top-level objects are). The ``plain``
variant trains the same model on the same data without ckptio and ends the same way; with ``--before-src`` a
``before`` variant runs the ckptio job on another checkout's ``src`` (e.g. ``git worktree add /tmp/old <rev>``, then
``--before-src /tmp/old/src``), to compare a change in one run. Variants are interleaved
run by run, so both see the same machine. ``--load N`` keeps N busy processes running beside the jobs, as another
job on the machine would.

A run fails when either ``torchrun`` exits non-zero; the tally counts the failures whose log shows a rank killed by
SIGABRT (``terminate called ...``), and prints the first lines of each distinct failure. ``--cores K`` keeps the
core files of the first K aborts (``ulimit -c``) in ``--keep`` for ``gdb``: ``thread apply all bt`` names the
thread that was still running.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from distributed import free_port, kill_group  # noqa: E402

WORKER = TESTS / "memory_node_worker.py"


def _cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    os.setsid()


_BEFORE: dict[str, str] = {}


def _node(base: Path, node: int, port: int, variant: str, cores: bool) -> subprocess.Popen:
    env = {**os.environ, "CKPTIO_MEMORY_DIR": str(base / f"mem{node}"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    if variant == "before":
        env["PYTHONPATH"] = _BEFORE["src"]
    extra = ["--no-ckptio"] if variant == "plain" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
           "--master-addr=127.0.0.1", f"--master-port={port}", "--nproc-per-node=2", "--max-restarts=0",
           str(WORKER), "--ckpt", str(base / "ckpt"), "--steps", "20", "--memory-every", "2", "--persist-every", "10",
           "--out", str(base / f"out{node}"), "--natural-exit", *extra]
    log = open(base / f"log{node}.txt", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=base,
                            preexec_fn=_cores if cores else os.setsid)


def _one(base: Path, variant: str, cores: bool, timeout: float) -> tuple[bool, bool, str]:
    """One run: (failed, aborted, the log's telling lines)."""
    port = free_port()
    procs = [_node(base, n, port, variant, cores) for n in (0, 1)]
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            codes.append(-9)
    text = "\n".join((base / f"log{n}.txt").read_text(errors="replace") for n in (0, 1))
    aborted = "SIGABRT" in text or "terminate called" in text or "exitcode  : -6" in text
    telling = [ln for ln in text.splitlines() if any(w in ln for w in ("terminate called", "SIGABRT", "Error",
                                                                          "Fatal Python", "Thread 0x", "File \""))]
    return any(codes), aborted, "\n".join(telling[:40])


def _hog(stop: "mp.synchronize.Event") -> None:  # type: ignore[name-defined]
    x = 0
    while not stop.is_set():
        for _ in range(100000):
            x += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=100, help="runs of each variant")
    p.add_argument("--variants", default="ckptio,plain")
    p.add_argument("--load", type=int, default=0, help="busy processes beside the jobs")
    p.add_argument("--cores", type=int, default=0, help="keep the core files of the first K aborts")
    p.add_argument("--keep", default="exit_aborts_cores", help="where kept core files and logs go")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--before-src", default=None, help="another checkout's src/: adds the variant 'before'")
    args = p.parse_args()
    variants = args.variants.split(",")
    if args.before_src:
        _BEFORE["src"] = str(Path(args.before_src).resolve())
        variants.insert(0, "before")
    stop = mp.Event()
    hogs = [mp.Process(target=_hog, args=(stop,), daemon=True) for _ in range(args.load)]
    for h in hogs:
        h.start()
    tally = {v: collections.Counter() for v in variants}
    kept = 0
    start = time.monotonic()
    try:
        for i in range(args.runs):
            for variant in variants:
                with tempfile.TemporaryDirectory(prefix="exit-aborts-") as tmp:
                    base = Path(tmp)
                    failed, aborted, telling = _one(base, variant, kept < args.cores, args.timeout)
                    tally[variant]["runs"] += 1
                    tally[variant]["failed"] += failed
                    tally[variant]["aborted"] += aborted
                    if failed:
                        print(f"--- run {i} {variant}: failed{' (SIGABRT)' if aborted else ''}\n{telling}", flush=True)
                        found = list(base.glob("core*"))
                        if found and kept < args.cores:
                            dest = Path(args.keep) / f"run{i}-{variant}"
                            dest.mkdir(parents=True, exist_ok=True)
                            for f in [*found, *base.glob("log*.txt")]:
                                shutil.move(str(f), dest / f.name)
                            kept += 1
            line = "  ".join(f"{v}: {t['failed']}/{t['runs']} failed ({t['aborted']} SIGABRT)" for v, t in
                             tally.items())
            print(f"[{i + 1}/{args.runs}, {time.monotonic() - start:.0f} s] {line}", flush=True)
    finally:
        stop.set()
    for v, t in tally.items():
        print(f"{v}: {t['runs']} runs, {t['failed']} failed, {t['aborted']} of them by SIGABRT at exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
