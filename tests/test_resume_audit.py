"""The resume audit (issue 68): the steps after each durable save are recorded from what the loop gives
``maybe_save(metrics=...)``, and a resumed run's same steps are compared with them: exact, within a tolerance, or
diverged at a step with the likely causes ckptio can see.

The runs are real processes: a plain loop of one's own (``tests/audit_loop.py``: a tiny model with dropout, a
``ResumableDataLoader`` that shuffles, AdamW, a scheduler) killed with SIGKILL three steps after a save and resumed,
on 1 rank and on 2 (gloo)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.errors import CheckpointError, ConfigError
from ckptio.goodput.record import RECORD_NAME, dump, parse

from distributed import launch

HERE = Path(__file__).resolve().parent
LOOP = str(HERE / "audit_loop.py")


def _events(folder: Path) -> list[dict]:
    return parse((folder / RECORD_NAME).read_bytes(), folder)


def _run(folder: Path, *args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    return launch(LOOP, str(folder), *args, ranks=ranks, timeout=120)


def _killed_and_resumed(folder: Path, *left_out: str, ranks: int = 1) -> tuple[list[dict], str]:
    """Run to step 8 (saves at 5), killed there; resumed to step 12 leaving ``left_out`` out of the manager."""
    first = _run(folder, "12", "8", ranks=ranks)
    assert first.returncode != 0, "the first run was to be killed at step 8"
    events = _events(folder)
    recorded = [e for e in events if e["kind"] == "metrics"]
    assert [e["step"] for e in recorded] == [6, 7, 8], recorded
    assert all({"loss", "grad_norm", "lr"} <= set(e) for e in recorded)
    assert not any(e["kind"] == "end" for e in events), "a killed run has no end"
    second = _run(folder, "12", "0", *left_out, ranks=ranks)
    assert second.returncode == 0, second.stdout + second.stderr
    audits = [e for e in _events(folder) if e["kind"] == "audit"]
    assert len(audits) == 1, audits
    return audits, second.stdout + second.stderr


# ------------------------------------------------------------------------------------------ real processes
def test_a_plain_loop_killed_after_a_save_and_resumed_is_audited_exact(tmp_path):
    audits, out = _killed_and_resumed(tmp_path)
    assert audits[0]["verdict"] == "exact" and audits[0]["step"] == 5 and audits[0]["checked"] == 3, audits
    lines = [line for line in out.splitlines() if "Resume audit" in line]
    assert len(lines) == 1 and "exact" in lines[0], out


@pytest.mark.parametrize("left_out, cause", [("no-dataloader", "dataloader"), ("no-rng", "rng")])
def test_a_resume_that_leaves_a_state_out_is_told_it_diverged_naming_that_state(tmp_path, left_out, cause):
    audits, out = _killed_and_resumed(tmp_path, left_out)
    audit = audits[0]
    assert audit["verdict"] == "diverged" and audit["at"] == 6, audit
    assert audit["causes"] == [cause], audit  # the scheduler was given and its lr matches: not blamed
    assert audit["loss"] != audit["loss_was"] and audit["lr"] == audit["lr_was"]
    lines = [line for line in out.splitlines() if "Resume audit" in line]
    assert len(lines) == 1 and "DIVERGED at step 6" in lines[0] and f"loss {audit['loss']:.8g} now" in lines[0]
    assert {"dataloader": "data loader", "rng": "rng=False"}[cause] in lines[0], lines[0]


def test_on_two_ranks_a_killed_run_resumed_is_audited_exact_and_without_the_loader_it_diverged(tmp_path):
    audits, _ = _killed_and_resumed(tmp_path / "exact", ranks=2)
    assert audits[0]["verdict"] == "exact" and audits[0]["checked"] == 3, audits
    audits, _ = _killed_and_resumed(tmp_path / "wrong", "no-dataloader", ranks=2)
    assert audits[0]["verdict"] == "diverged" and audits[0]["causes"] == ["dataloader"], audits
    third = _run(tmp_path / "exact", "12", "0")  # the run of 2 ranks resumed again from step 5, on 1 rank
    assert third.returncode == 0, third.stderr[-2000:]
    audits = [e for e in _events(tmp_path / "exact") if e["kind"] == "audit"]
    assert audits[-1]["verdict"] == "diverged" and audits[-1]["causes"] == ["ranks"], audits


def _killed_after_a_snapshot_and_resumed(folder: Path, *left_out: str) -> tuple[dict, str]:
    """Snapshots at 4 and 8, durable saves at 6 and 12; killed at 11 (three steps after the snapshot of 8, newer than
    the durable 6), resumed from the memory tier to step 14 leaving ``left_out`` out of the manager."""
    folder.mkdir()
    env = {"CKPTIO_MEMORY_DIR": str(folder / "shm")}
    every = ("memory=4", "persist=6")
    first = launch(LOOP, str(folder / "ckpt"), "14", "11", *every, env=env, timeout=120)
    assert first.returncode != 0, "the first run was to be killed at step 11"
    recorded = sorted({e["step"] for e in _events(folder / "ckpt") if e["kind"] == "metrics"})
    assert recorded == [5, 6, 7, 8, 9, 10, 11], recorded  # after the snapshot of 4, the save of 6, the snapshot of 8
    second = launch(LOOP, str(folder / "ckpt"), "14", "0", *every, *left_out, env=env, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    events = _events(folder / "ckpt")
    assert [(e["step"], e["tier"]) for e in events if e["kind"] == "restore"] == [(8, "memory")], events
    audits = [e for e in events if e["kind"] == "audit"]
    assert len(audits) == 1, audits
    return audits[0], second.stdout + second.stderr


def test_a_loop_killed_after_a_memory_snapshot_and_resumed_from_it_is_audited_exact_and_without_its_loader_not(
        tmp_path):
    audit, out = _killed_after_a_snapshot_and_resumed(tmp_path / "exact")
    assert audit["verdict"] == "exact" and audit["step"] == 8 and audit["checked"] == 3, audit
    audit, out = _killed_after_a_snapshot_and_resumed(tmp_path / "wrong", "no-dataloader")
    assert audit["verdict"] == "diverged" and audit["step"] == 8 and audit["at"] == 9, audit
    assert audit["causes"] == ["dataloader"], audit
    assert "DIVERGED at step 9" in out and "data loader" in out, out


# ------------------------------------------------------------------------------------------ in this process
def _manager(folder: Path, **config) -> CheckpointManager:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return CheckpointManager(CheckpointConfig(checkpoint_dir=folder, persist_every_steps=2, **config), model=model,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _feed(mgr: CheckpointManager, losses: dict[int, float]) -> None:
    for step, loss in losses.items():
        mgr.maybe_save(step=step, metrics={"loss": loss, "lr": 0.1, "accuracy": 0.5})


def test_within_the_tolerance_and_beyond_it(tmp_path):
    mgr = _manager(tmp_path, audit_tolerance=1e-3)
    _feed(mgr, {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.6})  # saves at 2 and 4; records 3, 4, 5 and 5
    mgr.close()
    mgr = _manager(tmp_path, audit_tolerance=1e-3)
    mgr.restore(tmp_path / "epoch_0_step_2")
    _feed(mgr, {3: 0.8, 4: 0.70003})
    mgr.close()
    mgr = _manager(tmp_path, audit_tolerance=1e-3)
    mgr.restore(tmp_path / "epoch_0_step_2")
    _feed(mgr, {3: 0.8, 4: 0.71})
    mgr.close()
    audits = [e for e in _events(tmp_path) if e["kind"] == "audit"]
    assert [a["verdict"] for a in audits] == ["tolerance", "diverged"], audits
    assert audits[0]["checked"] == 2 and audits[0]["tolerance"] == 1e-3
    assert audits[1]["at"] == 4 and audits[1]["loss"] == 0.71 and audits[1]["loss_was"] == 0.7


def test_non_finite_values_are_recorded_and_compared(tmp_path):
    mgr = _manager(tmp_path)
    _feed(mgr, {1: 1.0, 2: 0.9, 3: math.nan, 4: math.inf, 5: 0.5})
    mgr.close()
    recorded = {e["step"]: e["loss"] for e in _events(tmp_path) if e["kind"] == "metrics"}
    assert recorded[3] == "nan" and recorded[4] == "inf"
    mgr = _manager(tmp_path)
    mgr.restore(tmp_path / "epoch_0_step_2")
    _feed(mgr, {3: math.nan, 4: math.inf, 5: 0.5})
    mgr.close()
    assert [e["verdict"] for e in _events(tmp_path) if e["kind"] == "audit"] == ["exact"]


def test_audit_steps_zero_records_nothing_and_bad_settings_are_refused(tmp_path):
    mgr = _manager(tmp_path, audit_steps=0)
    _feed(mgr, {1: 1.0, 2: 0.9, 3: 0.8})
    mgr.close()
    assert not [e for e in _events(tmp_path) if e["kind"] == "metrics"]
    for bad in ({"audit_steps": -1}, {"audit_steps": 1.5}, {"audit_steps": 101}, {"audit_tolerance": -0.1},
                {"audit_tolerance": math.nan}, {"audit_tolerance": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            CheckpointConfig(checkpoint_dir=tmp_path, **bad)


# ------------------------------------------------------------------------------------------ the record's checks
def test_the_record_keeps_metrics_and_audits_typed_and_refuses_what_is_not():
    good = [{"kind": "metrics", "time": 1.0, "step": 3, "loss": -1.5, "grad_norm": "nan", "lr": 1e-4},
            {"kind": "audit", "time": 2.0, "step": 2, "verdict": "diverged", "checked": 1, "at": 3, "tolerance": 0.01,
             "causes": ["dataloader", "rng"], "loss": 2.0, "loss_was": "-inf"}]
    assert parse(dump(good), "r") == good
    for field, value in [("loss", 1e400), ("loss", "NaN"), ("loss", [1.0]), ("lr", True), ("verdict", "fine"),
                         ("causes", ["cosmic rays"]), ("causes", ["rng", "rng"]), ("causes", "rng"),
                         ("causes", ["rng"] * 20), ("at", -1), ("tolerance", 2.0), ("checked", 1.5)]:
        bad = dict(good[1], **{field: value})
        data = json.dumps({"format": "ckptio-record", "version": 1, "events": [bad]}).encode()
        with pytest.raises(CheckpointError, match=field):
            parse(data, "r")


def test_a_partial_load_is_named_among_the_causes(tmp_path):
    mgr = _manager(tmp_path)
    _feed(mgr, {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.7})
    mgr.close()
    mgr = _manager(tmp_path)
    info = mgr.restore(tmp_path / "epoch_0_step_2", exclude=["bias"], states=["model", "rng"])
    assert info.report.excluded and info.report.skipped_states
    _feed(mgr, {3: 0.85})
    mgr.close()
    audit = [e for e in _events(tmp_path) if e["kind"] == "audit"][-1]
    assert audit["verdict"] == "diverged" and audit["causes"] == ["dataloader", "load_exclude", "load_states"], audit
