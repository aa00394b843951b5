"""Run a test script as ``python script args`` or ``torchrun --nproc-per-node=N script args`` would, each rank a
process forked from the preloaded server of :mod:`distributed` instead of a fresh interpreter.

A fresh interpreter spends ~5-7 s here importing torch and transformers before the script's first line; a rank
forked from the server that already imported them (:data:`distributed.PRELOAD`) starts at once. Each rank is still a
process of its own, with the environment ``torchrun`` gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` with the store served there as torchrun's agent serves it, ``TORCHELASTIC_*``), the
caller's working folder (or the one given), torch's thread count from ``OMP_NUM_THREADS`` as a new interpreter
sets it, the script as ``__main__`` with its ``sys.argv`` and its folder first on ``sys.path``, and the end of an
interpreter's life: non-daemon threads joined, then ``atexit`` handlers run. What happens when a rank fails is what
``torchrun`` does: the others get SIGTERM, and SIGKILL 30 s later if they are still there. A rank's stdout and
stderr are returned as the launcher's, rank by rank.

:func:`start` with ``real=True`` starts the same as new interpreters instead (``python`` or the real ``torchrun``),
behind the same interface: a test picks the launcher, not the code that drives it.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Iterator

import torch
import torch.distributed as dist

TERM_GRACE = 30.0  # torchrun's own: how long the other ranks get between SIGTERM and SIGKILL after a rank failed


def _streams(tmp: str, rank: int) -> tuple[str, str]:
    return os.path.join(tmp, f"rank_{rank}.out"), os.path.join(tmp, f"rank_{rank}.err")


def _rank(script: str, args: list[str], env: dict[str, str], cwd: str, tmp: str, rank: int, merged: bool) -> None:
    """In the forked rank: become ``python script args`` and leave with its exit code."""
    code: object = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        if env.get("OMP_NUM_THREADS", "").isdigit():  # read once, at torch's import, by a new interpreter
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, path in zip((1, 2), _streams(tmp, rank)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        if merged:
            os.dup2(1, 2)
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # printed as the interpreter prints it: through sys.excepthook (torch's prefixes it)
            sys.excepthook(*sys.exc_info())
            code = 1
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        threading._shutdown()  # as an interpreter ends: its non-daemon threads first, then atexit
        atexit._run_exitfuncs()
    except BaseException:  # of the launcher itself, or raised at exit
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def _rank_env(base: dict[str, str], rank: int, ranks: int, port: int, run_id: str) -> dict[str, str]:
    if ranks == 1:
        return dict(base)
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with more than one process a node
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
               WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), ROLE_WORLD_SIZE=str(ranks), GROUP_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=run_id,
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_USE_AGENT_STORE="True")
    return env


def _signal(procs: list[mp.Process], sig: int) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass


def start(script: str, *args: str, ranks: int = 1, cwd: str | None = None, env: dict[str, str] | None = None,
          merged: bool = False, real: bool = False) -> Job | Interpreters:
    """``script args`` started on ``ranks`` processes: forked (:class:`Job`), or with ``real`` new interpreters
    (:class:`Interpreters`). ``merged``: each rank's stderr goes where its stdout goes."""
    kind = Interpreters if real else Job
    return kind(script, *args, ranks=ranks, cwd=cwd, env=env, merged=merged)


def run_script(script: str, *args: str, ranks: int = 1, timeout: float = 600, cwd: str | None = None,
               env: dict[str, str] | None = None, real: bool = False) -> subprocess.CompletedProcess:
    """:func:`start`, waited for: as ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)``
    returns."""
    return start(script, *args, ranks=ranks, cwd=cwd, env=env, real=real).wait(timeout)


class Interpreters:
    """``python script args`` or the real ``torchrun --standalone``, in a session of its own; the interface of
    :class:`Job`."""

    def __init__(self, script: str, *args: str, ranks: int = 1, cwd: str | None = None,
                 env: dict[str, str] | None = None, merged: bool = False) -> None:
        self.cmd = [sys.executable, script, *args] if ranks == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", script, *args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True, cwd=cwd,
                                     env=env, start_new_session=True)

    def lines(self, timeout: float) -> Iterator[str]:
        """Its output line by line as it is written (the caller keeps its own deadline)."""
        yield from self.proc.stdout  # type: ignore[misc]

    def signal(self, sig: int) -> None:
        """``sig`` to the whole job, as a scheduler sends it (torchrun's agent passes it on to its ranks)."""
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.communicate()
            raise
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, out, err or "")


class Job:
    """``script args`` started on ``ranks`` forked processes; ``merged``: each rank's stderr goes where its stdout
    goes (``stderr=subprocess.STDOUT``)."""

    def __init__(self, script: str, *args: str, ranks: int = 1, cwd: str | None = None,
                 env: dict[str, str] | None = None, merged: bool = False) -> None:
        from distributed import free_port, use_preloaded_server

        use_preloaded_server()
        ctx = mp.get_context("forkserver")
        base = dict(os.environ if env is None else env)
        port, run_id = free_port(), uuid.uuid4().hex[:12]
        self.cmd = [sys.executable, script, *args] if ranks == 1 else \
            ["torchrun", f"--nproc-per-node={ranks}", script, *args]
        # torchrun's agent serves the store on MASTER_PORT; its workers connect to it as clients
        self._store = None if ranks == 1 else dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        self._tmp = tempfile.TemporaryDirectory(prefix="ckptio-script-")
        self.ranks = ranks
        self.procs = [ctx.Process(target=_rank, args=(script, list(args), _rank_env(base, r, ranks, port, run_id),
                                                      cwd or os.getcwd(), self._tmp.name, r, merged))
                      for r in range(ranks)]
        for p in self.procs:
            p.start()
        self._failed: mp.Process | None = None
        self._term_at = 0.0

    def _watch(self) -> bool:
        """One look, as torchrun's agent looks: once a rank failed, SIGTERM to the others and SIGKILL after
        :data:`TERM_GRACE`. Whether a rank is still running."""
        if self._failed is None:
            self._failed = next((p for p in self.procs if p.exitcode not in (None, 0)), None)
            if self._failed is not None:
                self.signal(signal.SIGTERM)
                self._term_at = time.monotonic()
        elif time.monotonic() - self._term_at > TERM_GRACE:
            self.signal(signal.SIGKILL)
        return any(p.is_alive() for p in self.procs)

    def signal(self, sig: int) -> None:
        """``sig`` to every rank still running (what torchrun's agent does with a signal it receives)."""
        _signal(self.procs, sig)

    def lines(self, timeout: float) -> Iterator[str]:
        """Rank 0's output line by line as it is written, until every rank ended."""
        deadline, pending = time.monotonic() + timeout, ""
        path = _streams(self._tmp.name, 0)[0]
        while not os.path.exists(path) and self._watch():
            time.sleep(0.02)
        with open(path, errors="replace") if os.path.exists(path) else io.StringIO() as f:
            while True:
                running = self._watch()
                pending += f.read()
                *done, pending = pending.split("\n")
                yield from (line + "\n" for line in done)
                if not running:
                    break
                if time.monotonic() > deadline:
                    self._timeout(timeout)
                time.sleep(0.05)
        if pending:
            yield pending

    def _timeout(self, timeout: float) -> None:
        self.signal(signal.SIGKILL)
        raise subprocess.TimeoutExpired(self.cmd, timeout, self._joined(0), self._joined(1))

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess:
        """Every rank ended; the exit code is 0 if every rank's was, else the first failed rank's (negative: the
        signal that ended it). Past ``timeout`` every rank is killed and ``subprocess.TimeoutExpired`` raised."""
        deadline = time.monotonic() + timeout
        try:
            while self._watch():
                if time.monotonic() > deadline:
                    self._timeout(timeout)
                time.sleep(0.05)
        finally:
            self.signal(signal.SIGKILL)
            for p in self.procs:
                p.join(10)
        failed = self._failed
        code = failed.exitcode if failed is not None else next((p.exitcode for p in self.procs if p.exitcode), 0)
        out = subprocess.CompletedProcess(self.cmd, code, self._joined(0), self._joined(1))
        self._store = None
        self._tmp.cleanup()
        return out

    def _joined(self, which: int) -> str:
        parts = []
        for r in range(self.ranks):
            try:
                with open(_streams(self._tmp.name, r)[which], errors="replace") as f:
                    parts.append(f.read())
            except FileNotFoundError:
                pass
        return "".join(parts)
