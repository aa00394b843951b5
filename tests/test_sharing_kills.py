"""Saves that share files, killed with SIGKILL at random (issue 47): locally (hard links) and in a bucket
(references), a process is killed mid-write, mid-link, mid-commit, mid-retention, mid-optimizer-pruning and
mid-sweep, then the next one resumes and goes on. After every kill, every committed step verifies byte for byte
(no file missing, none torn, in a bucket no reference to a deleted object), and the newest one resumes bitwise
equal to the state a run never killed had at that step.

Each trial is a process forked from the test (torch imported once), killed either at a random instant or at the
n-th passage of a named point (:mod:`ckptio._faults`), so that the rare windows (between a link and the manifest,
between a manifest removed and the objects deleted) are hit on purpose, not by luck. ``CKPTIO_KILL_TRIALS`` and
``CKPTIO_KILL_TRIALS_S3``, ``CKPTIO_KILL_TRIALS_GS``, ``CKPTIO_KILL_TRIALS_AZ`` change the number of trials (default
100 locally, 12 on each object store; every other trial aims at the next point in turn: each point is aimed at 5
times locally, and each of a bucket's 9 points twice over the three stores, each store starting a third of the way
round from the one before). The bucket trials take the ``store`` fixture: S3 (moto), GCS
(fake-gcs-server) and Azure (Azurite), each on 127.0.0.1.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager, _faults
from ckptio.errors import CheckpointNotFoundError
from ckptio.engine.manifest import MANIFEST_NAME, check_files, read_manifest
from ckptio.storage import open_storage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

LAST = 24
POINTS = ["save.before_link", "save.states_written", "commit.before_manifest", "commit.before_rename",
          "commit.before_pointer", "commit.before_retention", "retention.before_delete",
          "retention.optimizer_after_manifest", "delete.after_hide", "sweep.before_remove"]


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64),
                                torch.nn.Linear(64, 512))
    for p in [*model[0].parameters(), *model[1].parameters()]:  # frozen: shared from save to save
        p.requires_grad_(False)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randint(0, 512, (4, 8), generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step % 5 == 0:  # now and then a frozen tensor edited in place: its file must be written anew
        with torch.no_grad():
            model[0].weight[step] += 0.5


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _reference() -> dict[int, dict[str, torch.Tensor]]:
    model, opt = _objects()
    out = {}
    for step in range(1, LAST + 1):
        _step(model, opt, step)
        out[step] = _state(model, opt)
    return out


def _config(root: str) -> CheckpointConfig:
    return CheckpointConfig(checkpoint_dir=root, keep_latest=3, keep_optimizer_latest=1)


def _child(root: str, point: str | None, nth: int) -> None:
    """The forked trial: resume and train on, saving every step; killed by the parent or at ``point``'s n-th passage."""
    try:
        if point is not None:
            seen = [0]

            def hook(name: str) -> None:
                if name == point:
                    seen[0] += 1
                    if seen[0] == nth:
                        os.kill(os.getpid(), signal.SIGKILL)

            _faults.set_hook(hook)
        model, opt = _objects()
        mgr = CheckpointManager(_config(root), model=model, optimizer=opt, rng=False)
        info = mgr.restore()
        step = info.step if info is not None else 0
        while step < LAST:
            step += 1
            _step(model, opt, step)
            mgr.save(step=step)
        mgr.close()
        os._exit(0)
    except BaseException:  # noqa: BLE001 - an error is a failed trial: the parent sees the exit code
        import traceback

        traceback.print_exc()
        os._exit(3)


def _check(root: str, reference: dict) -> int:
    """Every committed step whole; the newest resumes bitwise. Returns the newest step (0: none)."""
    storage = open_storage(root)
    top = storage.folder()
    steps = []
    try:
        listing = top.listdir()
    except CheckpointNotFoundError:  # killed before its first save made the folder
        return 0
    for entry in listing:
        if entry.kind != "dir" or entry.name.startswith(".") or top.sub(entry.name).kind(MANIFEST_NAME) != "file":
            continue
        folder = storage.folder(entry.name)
        manifest = read_manifest(folder)
        problems = check_files(folder, manifest, checksums=True)
        assert not problems, f"{entry.name}: {problems}"
        for rel, target in manifest.shared.items():  # a reference names an object that is there
            owner, _, path = target.partition("/")
            assert top.sub(owner).kind(path) == "file", f"{entry.name}: {rel} refers to {target}, which is gone"
        steps.append(manifest.step)
    if not steps:
        return 0
    model, opt = _objects()
    model[0].weight.data.zero_()  # nothing may come from the initial values
    with CheckpointManager(_config(root), model=model, optimizer=opt, rng=False) as mgr:
        info = mgr.restore()
    assert info is not None and info.step == max(steps)
    expected, got = reference[info.step], _state(model, opt)
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), f"step {info.step}: {k} differs after the resume"
    return info.step


def _trials(root: str, n: int, seed: int, max_delay: float, points: list[str], first: int = 0) -> dict[str, int]:
    reference = _reference()
    rng = random.Random(seed)
    counts = {"trials": 0, "killed": 0, "finished": 0, "resumed": 0}
    for i in range(n):  # every other trial aims at a named point, the points in turn from the ``first``
        point = points[(first + i // 2) % len(points)] if i % 2 == 0 else None
        pid = os.fork()
        if pid == 0:
            _child(root, point, rng.randint(1, 3))
        # at its point (which the hook reaches first), else at a random instant
        deadline = time.monotonic() + (rng.uniform(0.0, max_delay) if point is None else 3 * max_delay)
        done, status = 0, 0
        while not done and time.monotonic() < deadline:  # killed by the parent now, or at its point by itself
            time.sleep(0.005)
            done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status)
        assert killed or os.WEXITSTATUS(status) == 0, f"a trial failed (exit {os.WEXITSTATUS(status)})"
        counts["trials"] += 1
        counts["killed" if killed else "finished"] += 1
        newest = _check(root, reference)
        counts["resumed"] += newest > 0
        if newest >= LAST:  # the run is over: the next trials start another in a fresh folder
            root = f"{root.rstrip('/')}x"
    return counts


def test_local_saves_killed_at_random_never_leave_a_torn_or_missing_file(tmp_path):
    n = int(os.environ.get("CKPTIO_KILL_TRIALS", "100"))
    counts = _trials(str(tmp_path / "run"), n, seed=47, max_delay=0.5, points=POINTS)
    assert counts["trials"] == n and counts["killed"] >= n // 2, counts
    print(counts)


KILL_TRIALS = {"s3": ("CKPTIO_KILL_TRIALS_S3", "12", 48, 0), "gs": ("CKPTIO_KILL_TRIALS_GS", "12", 49, 6),
               "az": ("CKPTIO_KILL_TRIALS_AZ", "12", 50, 3)}
"""Per object store: the variable that sets its number of trials, the suite's number, the seed, the point its aimed
trials start from: S3 aims at points 0-5, GCS at 6-8 and 0-2, Azure at 3-8 (the objects' layer they test is one)."""


def test_bucket_saves_killed_at_random_never_refer_to_a_deleted_object(store):
    variable, default, seed, first = KILL_TRIALS[store.scheme]
    n = int(os.environ.get(variable, default))
    local_only = {"commit.before_rename"}  # a bucket has no rename: its commit is the manifest's conditional write
    counts = _trials(store.url("run"), n, seed=seed, max_delay=1.5, points=[p for p in POINTS if p not in local_only],
                     first=first)
    assert counts["trials"] == n and counts["killed"] >= n // 2, counts
    print(store.scheme, counts)
