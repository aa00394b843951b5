"""Run a test script as ``python script args`` or ``torchrun --nproc-per-node=N script args`` would, each rank a
process forked from the preloaded server of :mod:`distributed` instead of a fresh interpreter.

A fresh interpreter spends ~5-7 s here importing torch and transformers before the script's first line; a rank
forked from the server that already imported them (:data:`distributed.PRELOAD`) starts at once. Each rank is still a
process of its own, with the environment ``torchrun`` gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` with the store served there as torchrun's agent serves it, ``TORCHELASTIC_*``), the
caller's working folder, the script as ``__main__`` with
its ``sys.argv`` and its folder first on ``sys.path``, and the end of an interpreter's life: non-daemon threads
joined, then ``atexit`` handlers run. What happens when a rank fails is what ``torchrun`` does: the others get
SIGTERM, and SIGKILL 30 s later if they are still there. A rank's stdout and stderr are returned as the
launcher's, rank by rank.
"""

from __future__ import annotations

import atexit
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

import torch.distributed as dist

TERM_GRACE = 30.0  # torchrun's own: how long the other ranks get between SIGTERM and SIGKILL after a rank failed


def _streams(tmp: str, rank: int) -> tuple[str, str]:
    return os.path.join(tmp, f"rank_{rank}.out"), os.path.join(tmp, f"rank_{rank}.err")


def _rank(script: str, args: list[str], env: dict[str, str], cwd: str, tmp: str, rank: int) -> None:
    """In the forked rank: become ``python script args`` and leave with its exit code."""
    code: object = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        for fd, path in zip((1, 2), _streams(tmp, rank)):
            sys.stdout.flush()
            sys.stderr.flush()
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
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


def run_script(script: str, *args: str, ranks: int = 1, timeout: float = 600, cwd: str | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``script args`` on ``ranks`` forked processes (see the module's docstring); its exit code is 0 if every
    rank's was, else the first failed rank's (negative: the signal that ended it). ``timeout`` as
    ``subprocess.run``'s: every rank is killed and ``subprocess.TimeoutExpired`` raised."""
    from distributed import free_port, use_preloaded_server

    use_preloaded_server()
    ctx = mp.get_context("forkserver")
    base = dict(os.environ if env is None else env)
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    cmd = [sys.executable, script, *args] if ranks == 1 else \
        ["torchrun", f"--nproc-per-node={ranks}", script, *args]
    # torchrun's agent serves the store on MASTER_PORT; its workers connect to it as clients
    store = None if ranks == 1 else dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="ckptio-script-") as tmp:
        procs = [ctx.Process(target=_rank, args=(script, list(args), _rank_env(base, r, ranks, port, run_id),
                                                 cwd or os.getcwd(), tmp, r)) for r in range(ranks)]
        for p in procs:
            p.start()
        deadline, failed, term_at = time.monotonic() + timeout, None, None
        try:
            while any(p.is_alive() for p in procs):
                if time.monotonic() > deadline:
                    _signal(procs, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(cmd, timeout, _joined(tmp, ranks, 0), _joined(tmp, ranks, 1))
                if failed is None:
                    failed = next((p for p in procs if p.exitcode not in (None, 0)), None)
                    if failed is not None:  # torchrun's agent: stop the others, then kill what is left
                        _signal(procs, signal.SIGTERM)
                        term_at = time.monotonic()
                elif time.monotonic() - term_at > TERM_GRACE:
                    _signal(procs, signal.SIGKILL)
                time.sleep(0.05)
        finally:
            _signal(procs, signal.SIGKILL)
            for p in procs:
                p.join(10)
        del store
        code = failed.exitcode if failed is not None else next((p.exitcode for p in procs if p.exitcode), 0)
        return subprocess.CompletedProcess(cmd, code, _joined(tmp, ranks, 0), _joined(tmp, ranks, 1))


def _joined(tmp: str, ranks: int, which: int) -> str:
    out = []
    for r in range(ranks):
        try:
            with open(_streams(tmp, r)[which], errors="replace") as f:
                out.append(f.read())
        except FileNotFoundError:
            pass
    return "".join(out)
