"""Run a test function on N real processes (gloo on CPU), each with its own rank.

``run_ranks(n, fn, **kwargs)`` starts ``n`` processes; each initialises a gloo process group through a file
store in a temporary folder (world size 1 runs without any process group, exercising the single-process
path), calls ``fn(**kwargs)`` and saves its return value. The parent gathers the results (loaded with
``weights_only=True``) and fails with every rank's exit code and the end of its output if any rank failed or
the deadline passed.

How ranks start (``CKPTIO_TEST_START``): ``forkserver`` (the default) forks each rank from a server process
that imported torch, ckptio and transformers once per test worker (:data:`PRELOAD`): a rank starts in a
fraction of a second instead of the ~5-20 s an interpreter takes to import them here. Each rank is still a
process of its own with its own process group; it takes the parent's current environment and working folder
(not the server's), and its output goes to a log file that the parent prints after the ranks end, so that
pytest shows it with the test. ``spawn`` starts each rank as a fresh interpreter (what the suite did before).

Exit path: after its work is done and the group destroyed, a rank leaves with ``os._exit`` — its
result is already on disk, flushed. This sidesteps a known teardown abort of the interpreter
("terminate called without an active exception") that hits a few percent of processes that imported
transformers, without hiding real failures: any exception in ``fn`` still exits non-zero with its
traceback printed.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

START = os.environ.get("CKPTIO_TEST_START", "forkserver")
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.tensor", "ckptio",
           "ckptio.manager", "transformers", "transformers.models.llama.modeling_llama", "transformers.trainer",
           "safetensors.torch", "peft", "accelerate", "pytorch_lightning", "toy", "distributed", "forked_scripts"]
"""What the fork server imports once (a name that is missing is skipped by ``multiprocessing``)."""


def _log_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank_{rank}.log")


def _as_parent(out_dir: str, rank: int, env: dict, cwd: str) -> None:
    """In a forked rank: the parent's environment and folder, and the rank's output into its log file."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    log = os.open(_log_path(out_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _worker(rank: int, world: int, store: str, fn: Callable[..., Any], kwargs: dict, out_dir: str,
            env: dict | None = None, cwd: str | None = None) -> None:
    code = 1
    try:
        if env is not None and cwd is not None:  # forked (spawned ranks start from the parent's own)
            _as_parent(out_dir, rank, env, cwd)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(rank), str(world), str(rank)
        import torch.distributed as dist

        if world > 1:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        result = fn(**kwargs)
        torch.save(result, os.path.join(out_dir, f"result_{rank}.pt"))
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
        code = 0
    except BaseException:  # reported below; the exit code carries the failure to the parent
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start_ranks(world: int, fn: Callable[..., Any], kwargs: dict, tmp: str,
                method: str = START) -> list[mp.Process]:
    """``world`` rank processes running ``fn``; ``method="forkserver"`` forks them from a server that already
    imported :data:`PRELOAD` (or what ``mp.set_forkserver_preload`` named before), each rank still a process of
    its own, with its output in ``tmp/rank_R.log``; ``"spawn"`` starts fresh interpreters."""
    ctx = mp.get_context(method)
    store = os.path.join(tmp, "store")
    forked = method == "forkserver"
    if forked:
        use_preloaded_server()
    extra = (dict(os.environ), os.getcwd()) if forked else ()
    procs = [ctx.Process(target=_worker, args=(r, world, store, fn, kwargs, tmp, *extra), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    return procs


def use_preloaded_server() -> None:
    """The fork server (started at its first use in this process) imports :data:`PRELOAD` first, unless the
    caller (a benchmark) already chose what it imports."""
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_preload_modules", None) == ["__main__"]:  # nobody chose: ours
        mp.set_forkserver_preload(PRELOAD)


def kill_all(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join(5)


def run_ranks(world: int, fn: Callable[..., Any], timeout: float = 300, **kwargs: Any) -> list[Any]:
    """Run ``fn(**kwargs)`` on ``world`` ranks; return each rank's result, indexed by rank."""
    with tempfile.TemporaryDirectory(prefix="ckptio-ranks-") as tmp:
        procs = start_ranks(world, fn, kwargs, tmp)
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{fn.__name__} on {world} rank(s) did not finish within {timeout} s")
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(2)  # give the other ranks a moment to report their own error
                    break
                time.sleep(0.05)
        finally:
            kill_all(procs)
        logs = rank_logs(tmp, world)
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            tails = "".join(f"\n--- rank {r} (exit code {c}), the end of its output:\n{logs[r][-4000:]}"
                            for r, c in enumerate(codes) if c != 0)
            raise AssertionError(f"{fn.__name__} on {world} rank(s) failed; exit codes by rank: {codes}{tails}")
        return [torch.load(Path(tmp) / f"result_{r}.pt", weights_only=True) for r in range(world)]


def rank_logs(tmp: str, world: int) -> list[str]:
    """What each forked rank printed (empty for spawned ranks, whose output went to the parent's own streams),
    echoed to this process's streams so that pytest shows it with the test."""
    logs = []
    for r in range(world):
        try:
            with open(_log_path(tmp, r), errors="replace") as f:
                logs.append(f.read())
        except FileNotFoundError:
            logs.append("")
        if logs[-1]:
            sys.stderr.write(f"--- rank {r} of {world}:\n{logs[-1]}")
    return logs


COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "barrier",
               "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor", "gather",
               "scatter", "all_to_all", "monitored_barrier")


@contextmanager
def counting_collectives() -> Iterator[collections.Counter]:
    """Within this block, count each call that reaches ``torch.distributed``'s collectives, by name (every call
    still runs for real: the functions are wrapped, not replaced)."""
    import torch.distributed as dist

    counts: collections.Counter = collections.Counter()
    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in real.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
"""torch's object collectives, counted once by :func:`counting_collectives` but two collectives each on the wire (the
sizes, then the bytes; their inner calls do not go through ``torch.distributed``'s names)."""


def real_collectives(counts: dict[str, int]) -> int:
    """The collectives ``counts`` (from :func:`counting_collectives`) made on the wire."""
    return sum(n * (2 if name in OBJECT_COLLECTIVES else 1) for name, n in counts.items())


def kill_at(spec: str) -> None:
    """``POINT:N``: this process SIGKILLs itself the N-th time a ckptio save reaches the fault point POINT
    (``ckptio._faults``), as a preemption without notice would at that instant."""
    from ckptio import _faults

    point, n = spec.split(":")
    seen = [0]

    def hook(name: str) -> None:
        if name == point:
            seen[0] += 1
            if seen[0] == int(n):
                os.kill(os.getpid(), signal.SIGKILL)

    _faults.set_hook(hook)



def launch(script: str, *args: str, ranks: int = 1, timeout: float = 600, cwd: str | None = None,
           env: dict[str, str] | None = None, real: bool = False) -> subprocess.CompletedProcess:
    """``python script args`` in a process of its own (``ranks=1``) or as under torchrun with ``ranks`` CPU ranks on
    this machine; its output captured as text. Each rank is forked from the preloaded server
    (:mod:`forked_scripts`) unless ``real`` or ``CKPTIO_TEST_START=spawn``: then the interpreters start from
    scratch, under the real torchrun."""
    from forked_scripts import run_script

    return run_script(script, *args, ranks=ranks, timeout=timeout, cwd=cwd, env=env, real=real or START != "forkserver")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a torchrun rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_or_kill(proc: subprocess.Popen, timeout: float, log: Callable[[], str]) -> int:
    """``proc``'s exit code; past ``timeout``, its whole process group is killed and the test fails with ``log()``."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise AssertionError(f"job timed out; its log:\n{log()}") from None


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from ``/proc``), deepest last."""
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path("/proc", entry, "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    found, todo = [], list(children[pid])
    while todo:
        found.append(todo.pop(0))
        todo += children[found[-1]]
    return found


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its process group and every process under it (a job scheduler taking a job down, or a node
    lost), if anything of it is left. ``torchrun`` starts each rank in a session of its own: killing the agent's
    group alone would leave its ranks running, orphaned."""
    if proc.poll() is None:  # (once reaped, its pid may be another process's: only its group is signalled)
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGSTOP)  # none of them runs on (or starts another) while the rest are found
            except ProcessLookupError:
                pass
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it ended on its own (its ranks saw a peer die)
    proc.wait()
