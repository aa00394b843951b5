"""Kill trials of the memory tier: a node of a 2-node job SIGKILLed at a random moment.

Run by ``tools/fault_injection.py --memory``.

The job is ``tests/memory_node_worker.py`` on two ``torchrun`` "nodes" of 2 ranks each on 127.0.0.1, each node with
its own memory folder: FSDP2 tiny Llama, a memory snapshot every 2 steps (replicated on the other node), a durable
save every 6, 24 steps. One uninterrupted run records the whole state at every save and at the end.

Each trial starts the job, waits until the snapshot of a random step is committed, then at a random moment within
the time a snapshot interval has taken SIGKILLs one node's whole process tree (its torchrun agent and ranks: a node
lost; kills land mid-step, mid-snapshot, mid-replication and mid-durable-save) and the other node's a moment later
(the scheduler taking the job down). Half the time the lost node comes back with its memory wiped (a new
machine). Then:

- every committed durable checkpoint is verified byte for byte against its manifest;
- the job is started again on both nodes and runs to the end; what it restored must be a committed step no older
  than the newest durable checkpoint and than the newest snapshot committed on a node that kept its memory,
  never a fresh start once anything was committed, bitwise equal to the uninterrupted run's state at that step,
  and its final state bitwise equal to the uninterrupted run's.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from distributed import free_port, kill_group  # noqa: E402
from test_memory_tier import _job, _logs, _run, _same  # noqa: E402

from ckptio import committed_checkpoints  # noqa: E402
from ckptio.engine.manifest import check_files  # noqa: E402

STEPS, MEMORY_EVERY, PERSIST_EVERY = 24, 2, 6
JOB = ("--steps", str(STEPS), "--memory-every", str(MEMORY_EVERY), "--persist-every", str(PERSIST_EVERY))


def _node(base: Path, node: int, port: int, *extra: str) -> subprocess.Popen:
    """One node of the job, as the memory tier's tests start it (the arguments here override theirs)."""
    return _job(base, node, 2, 2, port, *JOB, *extra)


def snapshots(mem: Path) -> set[int]:
    """The steps of the snapshots committed in one node's memory folder (a committed one has its manifest)."""
    return {int(d.name.rsplit("_", 1)[1]) for d in mem.glob("run-*/epoch_*_step_*") if (d / "manifest.json").is_file()}


def durable(base: Path) -> list:
    return committed_checkpoints(str(base / "ckpt")) if (base / "ckpt").is_dir() else []


def reference(base: Path) -> tuple[dict, float]:
    """The uninterrupted job: the whole state at every save and at the end, and how long it runs after its first
    snapshot is committed (the window in which trials kill)."""
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [_node(base, n, port, "--dump") for n in (0, 1)]
    first = None
    while any(p.poll() is None for p in procs):
        if first is None and (snapshots(base / "mem0") or snapshots(base / "mem1")):
            first = time.monotonic()
        time.sleep(0.05)
    assert all(p.returncode == 0 for p in procs), f"the reference job failed:\n{_logs(base)}"
    assert first is not None, "the reference job committed no snapshot"
    states = {s: torch.load(base / "out0" / f"state_{s}.pt") for s in range(MEMORY_EVERY, STEPS + 1, MEMORY_EVERY)}
    states["final"] = torch.load(base / "out0" / "final.pt")["state"]
    return states, time.monotonic() - first


def trial(base: Path, ref: dict, window: float, rng: random.Random) -> dict:
    """One trial in the empty folder ``base``; raises AssertionError naming what broke."""
    port = free_port()
    procs = [_node(base, n, port) for n in (0, 1)]
    try:
        # the kill lands at a random step: after the snapshot of a random step is committed, within the time
        # the job has taken per snapshot so far (whatever the machine's load makes of the job's speed)
        target = rng.randrange(MEMORY_EVERY, STEPS - MEMORY_EVERY + 1, MEMORY_EVERY)
        deadline, first = time.monotonic() + 600, None
        while (newest := max(snapshots(base / "mem0") | snapshots(base / "mem1"), default=0)) < target:
            assert time.monotonic() < deadline, f"no snapshot of step {target} within 600 s:\n{_logs(base)}"
            assert all(p.poll() is None for p in procs), f"the job ended before step {target}:\n{_logs(base)}"
            first = first if first or not newest else (time.monotonic(), newest)
            time.sleep(0.02)
        per = (time.monotonic() - first[0]) / max(1, (newest - first[1]) // MEMORY_EVERY) if first else window / 10
        time.sleep(rng.uniform(0.0, 1.5 * per))
        victim = rng.randrange(2)
        ended = procs[victim].poll() is not None  # the job finished before the kill: a trial of nothing
        kill_group(procs[victim])  # a node lost: its agent and ranks at once, nothing flushed
        time.sleep(rng.uniform(0.0, 1.0))
    finally:
        for proc in procs:
            kill_group(proc)
    survivors = [n for n in (0, 1) if n != victim]
    replaced = rng.random() < 0.5
    if replaced:
        shutil.rmtree(base / f"mem{victim}", ignore_errors=True)
    else:
        survivors.append(victim)
    committed = [e.step for e in durable(base)]
    kept = max((s for n in survivors for s in snapshots(base / f"mem{n}")), default=-1)
    floor = max([*committed, kept, -1])
    for e in durable(base):
        assert not check_files(e.path, e.manifest, checksums=True), f"{e.path} is damaged"
    for log in base.glob("log*.txt"):
        log.rename(log.with_suffix(".killed"))
    _run(base, every=JOB)
    restored = torch.load(base / "out0" / "restored.pt")
    step, tier = restored["step"], restored["tier"]
    assert step >= floor, f"restored step {step} ({tier}), but step {floor} was committed:\n{_logs(base)}"
    if step >= 0:
        _same(ref[step], restored["state"], f"the state restored at step {step} from the {tier} tier")
    _same(ref["final"], torch.load(base / "out0" / "final.pt")["state"], "the final state")
    return {"step": step, "tier": tier, "floor": floor, "replaced": replaced, "victim": victim, "ended": ended,
            "durable": committed, "target": target}
