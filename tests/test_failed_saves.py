"""A failed save does not end the run unless asked (issue 68): a background save or a memory-tier snapshot that fails
is logged, recorded and shown by ``ckptio report``; training goes on and the next save tries again; only
``failed_saves_allowed`` failures in a row are tolerated. A synchronous save raises unless ``sync_saves_may_fail``.
Nothing of a failed save is ever committed.

The failures are real: an in-place edit that the background save's staging copies catch, and an ``OSError`` (no
space left) raised at ckptio's own fault point after a save wrote its states, which is where a full disk stops it.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager, _faults
from ckptio._log import get_logger
from ckptio.engine.layout import committed_checkpoints
from ckptio.errors import CheckpointError, ConfigError
from cli_here import ckptio_here

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    opt.zero_grad()


def _full_disk_at(point: str, times: int = 10**9):
    """A fault hook: ``OSError`` (no space left) the first ``times`` times ``point`` is passed."""
    fired: list[str] = []

    def hook(name: str) -> None:
        if name == point and len(fired) < times:
            fired.append(name)
            raise OSError(errno.ENOSPC, "No space left on device")
    return hook


def _no_temporaries(root: Path) -> None:
    left = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert not left, left


def test_background_saves_that_fail_are_logged_recorded_and_training_goes_on(tmp_path, caplog):
    """Steps 1, 3, 4 and 5 fail in the background (an in-place edit the staging copies catch); 2 commits. The run
    goes on through two failures in a row (``failed_saves_allowed=2``); the third in a row raises, at the save after
    it. The report names the failed saves; nothing of them is committed."""
    get_logger()
    root = tmp_path / "ck"
    model, opt = _objects()
    _step(model, opt)
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), async_save=True, failed_saves_allowed=2),
                            model=model, optimizer=opt, rng=False)
    _faults.set_hook(lambda name: time.sleep(0.2) if name == "save.staging_copies" else None)
    try:
        with caplog.at_level(logging.ERROR, logger="ckptio"):
            for step in (1, 2, 3, 4):
                mgr.save(step=step)
                if step != 2:
                    with torch.no_grad():
                        model[0].weight.add_(1.0)  # breaks the rule: changed while the copies are pending
                _step(model, opt)
            mgr.save(step=5)  # settles 4's failure: the second in a row, tolerated
            with torch.no_grad():
                model[0].weight.add_(1.0)
            _step(model, opt)
            with pytest.raises(CheckpointError, match="changed in place") as raised:
                mgr.save(step=6)  # 5's failure is the third in a row
    finally:
        _faults.set_hook(None)
    assert any("failed_saves_allowed=2" in note for note in raised.value.__notes__)
    said = [r.getMessage() for r in caplog.records if "failed and is not committed" in r.getMessage()]
    assert len(said) == 3 and "of step 1" in said[0] and "Training goes on" in said[0], said
    mgr.close()
    assert [e.step for e in committed_checkpoints(str(root))] == [2]
    _no_temporaries(root)
    record = json.loads((root / ".ckptio_record.json").read_text())
    failed = [(e["tier"], e.get("step")) for e in record["events"] if e["kind"] == "save_failed"]
    assert failed == [("durable", 1), ("durable", 3), ("durable", 4), ("durable", 5)], failed
    out = ckptio_here("report", root)
    assert out.returncode == 0 and "Failed saves (training went on): 4 (durable 1, durable 3" in out.stdout, out
    page = tmp_path / "report.html"
    out = ckptio_here("report", root, "--html", page)
    assert out.returncode == 0 and '"failed_saves": [{' in page.read_text(), out.stderr


def test_a_synchronous_save_raises_unless_it_may_fail(tmp_path, caplog):
    """A full disk in a synchronous save raises as before; with ``sync_saves_may_fail`` it is logged, save() returns
    None, and the next save commits. The failed one leaves nothing behind, and an earlier checkpoint is untouched."""
    get_logger()
    for may_fail in (False, True):
        root = tmp_path / f"ck{may_fail}"
        model, opt = _objects()
        with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), sync_saves_may_fail=may_fail),
                               model=model, optimizer=opt, rng=False) as mgr:
            mgr.save(step=1)
            _faults.set_hook(_full_disk_at("save.states_written"))
            try:
                if not may_fail:
                    with pytest.raises((OSError, CheckpointError), match="No space left"):
                        mgr.save(step=2)
                else:
                    with caplog.at_level(logging.ERROR, logger="ckptio"):
                        assert mgr.save(step=2) is None
            finally:
                _faults.set_hook(None)
            if may_fail:
                assert any("durable save of step 2 failed" in r.getMessage() for r in caplog.records)
                _step(model, opt)
                assert mgr.save(step=3) is not None
        steps = [e.step for e in committed_checkpoints(str(root))]
        assert steps == ([1, 3] if may_fail else [1]), steps
        _no_temporaries(root)


def test_a_memory_tier_snapshot_that_fails_does_not_end_the_run(tmp_path, caplog):
    """The memory tier's snapshot of step 2 fails (no room left when its states are written); the next snapshot
    settles it with an error in the log and a ``save_failed`` event, and itself commits."""
    get_logger()
    root = tmp_path / "ck"
    model, opt = _objects()
    cfg = CheckpointConfig(checkpoint_dir=str(root), memory_every_steps=1, memory_dir=str(tmp_path / "mem"))
    with CheckpointManager(cfg, model=model, optimizer=opt, rng=False) as mgr:
        mgr.save_memory(step=1)
        mgr.wait()
        _faults.set_hook(_full_disk_at("memory.states_written", times=1))
        try:
            mgr.save_memory(step=2)  # fails in the background
            with caplog.at_level(logging.ERROR, logger="ckptio"):
                mgr.save_memory(step=3)  # settles step 2's failure first
        finally:
            _faults.set_hook(None)
        mgr.wait()
        mgr.save(step=3)
    assert any("memory-tier snapshot of step 2 failed" in r.getMessage() for r in caplog.records)
    record = json.loads((root / ".ckptio_record.json").read_text())
    assert [(e["tier"], e.get("step")) for e in record["events"] if e["kind"] == "save_failed"] == [("memory", 2)]


@pytest.mark.parametrize("tolerant", [True, False], ids=["tolerance-on", "tolerance-off"])
@pytest.mark.parametrize("point, background", [("save.states_written", False), ("commit.before_manifest", False),
                                               ("commit.before_rename", True)])
def test_a_save_failing_at_a_fault_point_commits_nothing_and_the_newest_restores_bitwise(tmp_path, point,
                                                                                         background, tolerant):
    """Issue 68, "nothing half-written is ever left committed", with failure tolerance on (``failed_saves_allowed=3``,
    ``sync_saves_may_fail``) and off (``failed_saves_allowed=0``): a durable save every 2 steps, the one of step 4
    fails at a fault point of ckptio's own (no space left), synchronous or in the background. On: training goes on and
    the next interval (6) commits; off: the run stops (the failure raised at 4, or at the save of 6 that settles it).
    Either way the failed save left nothing committed or lying around, every committed checkpoint is whole, and the
    newest restores bitwise."""
    from toy import full_state

    from ckptio.engine.manifest import check_files

    get_logger()
    root = tmp_path / "ck"
    model, opt = _objects()
    tolerance = dict(failed_saves_allowed=3, sync_saves_may_fail=True) if tolerant else dict(failed_saves_allowed=0)
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), persist_every_steps=2, async_save=background,
                                             **tolerance), model=model, optimizer=opt, rng=False)
    states, stopped = {}, None
    try:
        for step in range(1, 7):
            _step(model, opt)
            if step == 4:
                mgr.wait()  # the save of 2 committed (in the background: written later), before the fault is armed
                _faults.set_hook(_full_disk_at(point, times=1))
            try:
                mgr.maybe_save(step=step)
            except (OSError, CheckpointError) as exc:
                assert "No space left" in str(exc), exc
                stopped = step
                break
            if step % 2 == 0:
                states[step] = full_state(model, opt)
        mgr.close()
    finally:
        _faults.set_hook(None)
    if tolerant:
        assert stopped is None
        assert [e.step for e in committed_checkpoints(str(root))] == [2, 6]
    else:
        assert stopped == (6 if background else 4)
        assert [e.step for e in committed_checkpoints(str(root))] == [2]
    _no_temporaries(root)
    for e in committed_checkpoints(str(root)):
        assert not check_files(e.path, e.manifest, checksums=True), e.path
    model, opt = _objects()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root)), model=model, optimizer=opt, rng=False) as again:
        info = again.restore()
    newest = 6 if tolerant else 2
    assert info.step == newest
    restored = full_state(model, opt)
    assert restored.keys() == states[newest].keys()
    assert all(torch.equal(restored[k], states[newest][k]) for k in restored), f"step {newest} not restored bitwise"


@pytest.mark.parametrize("value", [-1, 1.5, "3", True, 10**7])
def test_failed_saves_allowed_is_a_count(tmp_path, value):
    with pytest.raises(ConfigError, match="failed_saves_allowed"):
        CheckpointConfig(checkpoint_dir=str(tmp_path), failed_saves_allowed=value)
