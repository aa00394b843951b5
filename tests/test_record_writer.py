"""The run's record written off the training thread (issue 68): the resume audit's ``metrics`` events, in windows that
overlap when the memory tier snapshots every step, are written by the record's own writer thread, so the training
loop pays no fsynced write a step; ``mgr.wait()`` and ``close()`` still leave them all on disk.

Which thread replaced the record is seen from the real write (a ``sys.addaudithook`` hook on ``os.rename``, which
``os.replace`` raises), not from a stand-in for the record or its storage."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.goodput.record import RECORD_NAME, parse

_REPLACED: list[tuple[int, str]] | None = None
"""While a test watches: (thread id, destination) of each ``os.replace`` onto a run's record."""


def _hook(event: str, args: tuple) -> None:
    if _REPLACED is not None and event == "os.rename" and len(args) > 1 and str(args[1]).endswith(RECORD_NAME):
        _REPLACED.append((threading.get_ident(), str(args[1])))


sys.addaudithook(_hook)  # hooks cannot be removed: it records only while a test sets _REPLACED


@pytest.fixture
def replaced():
    global _REPLACED
    _REPLACED = []
    try:
        yield _REPLACED
    finally:
        _REPLACED = None


def _manager(tmp_path: Path, **config) -> CheckpointManager:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    cfg = CheckpointConfig(checkpoint_dir=tmp_path / "ckpt", memory_dir=tmp_path / "shm", persist_every_steps=10**6,
                           memory_every_steps=1, **config)
    return CheckpointManager(cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _metrics(folder: Path) -> list[int]:
    events = parse((folder / RECORD_NAME).read_bytes(), folder)
    return sorted(e["step"] for e in events if e["kind"] == "metrics")


def test_snapshots_every_step_with_the_audit_on_write_the_record_off_the_training_thread(tmp_path, replaced):
    mgr = _manager(tmp_path)
    mgr.save(step=0)  # the record is written from the first save on
    del replaced[:]
    me = threading.get_ident()
    for step in range(1, 31):
        mgr.maybe_save(step=step, metrics={"loss": 1.0 / step, "grad_norm": 0.5, "lr": 0.1})
    on_loop = [r for r in replaced if r[0] == me]
    assert on_loop == [], f"{len(on_loop)} of the record's writes were made by the training thread"
    deadline = time.monotonic() + 30
    while not replaced and time.monotonic() < deadline:
        time.sleep(0.01)
    assert replaced and replaced[0][0] != me, "the record's thread never wrote it"
    mgr.wait()  # what is pending is on disk when wait returns
    assert _metrics(tmp_path / "ckpt") == list(range(1, 31))
    mgr.close()
    events = parse((tmp_path / "ckpt" / RECORD_NAME).read_bytes(), tmp_path)
    assert events[-1]["kind"] == "end" and _metrics(tmp_path / "ckpt") == list(range(1, 31))
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptio-record")], "the writer outlives close"


def test_close_writes_what_is_pending_and_a_forked_child_writes_its_own(tmp_path):
    mgr = _manager(tmp_path)
    mgr.save(step=0)
    for step in range(1, 6):
        mgr.maybe_save(step=step, metrics={"loss": 1.0, "lr": 0.1})
    record = mgr._goodput.record
    pid = os.fork()
    if pid == 0:  # the child: the parent's writer thread is not here; its own starts and the record is written
        code = 1
        try:
            record.add("metrics", background=True, step=99, loss=2.0)
            record.flush()
            code = 0 if 99 in _metrics(tmp_path / "ckpt") else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    mgr.close()
    assert set(range(1, 6)) <= set(_metrics(tmp_path / "ckpt"))
