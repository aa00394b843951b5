"""The resume audit fed by the framework integrations (issue 68): Lightning, the Hugging Face Trainer and accelerate
record the steps after each save in the run's record in their checkpoint folder, and a run resumed from one of
those saves is told ``exact``, or ``diverged`` at the first step that is not, with no line of the user's.

The runs are the real frameworks on CPU in processes of their own (accelerate also on 2 ranks under torchrun): a run
that saves, trains on and is stopped (SIGKILL, or its end), then a fresh process resumed from the save."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ckptio.goodput.record import RECORD_NAME, parse

from distributed import launch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def _events(folder: Path) -> list[dict]:
    return parse((folder / RECORD_NAME).read_bytes(), folder)


def _ok(done: subprocess.CompletedProcess, what: str) -> str:
    text = done.stdout + done.stderr
    assert done.returncode == 0, f"{what}:\n{text[-4000:]}"
    return text


def _report(folder: Path, capsys: pytest.CaptureFixture) -> str:
    from ckptio.cli import main

    capsys.readouterr()
    assert main(["report", str(folder), "--probe-mib", "0"]) == 0
    return capsys.readouterr().out


def _audits(folder: Path) -> list[dict]:
    return [e for e in _events(folder) if e["kind"] == "audit"]


def _said(text: str) -> list[str]:
    return [line for line in text.splitlines() if "Resume audit" in line]


# ------------------------------------------------------------------------------------------------------ accelerate
def _acc(*args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    return launch(str(TESTS / "acc_run.py"), *args, ranks=ranks, real=ranks > 1, timeout=300)


def _acc_killed_and_resumed(tmp_path: Path, *resume: str, ranks: int = 1) -> tuple[Path, str]:
    """A save every 3 steps, ``clip_grad_norm_`` each step, SIGKILLed after step 10; the newest save (step 9) is
    gone too, and a fresh process resumes from step 6 with ``resume``'s flags."""
    pytest.importorskip("accelerate")
    run = tmp_path / "run"
    first = _acc(str(run), str(tmp_path / "first.pt"), "--clip", "--sigkill-at", "10", ranks=ranks)
    assert first.returncode != 0, "the first run was to be killed after step 10"
    folder = run  # the project folder: accelerate takes every name in run/checkpoints for a checkpoint's
    recorded = [e for e in _events(folder) if e["kind"] == "metrics"]
    assert [e["step"] for e in recorded] == [4, 5, 6, 7, 8, 9], recorded  # step 10's, held, died with the process
    assert all({"loss", "grad_norm", "lr"} <= set(e) for e in recorded), recorded
    assert [e["step"] for e in _events(folder) if e["kind"] == "save"] == [3, 6, 9]
    shutil.rmtree(folder / "checkpoints" / "checkpoint_2")
    text = _ok(_acc(str(run), str(tmp_path / "resumed.pt"), "--clip", "--resume", *resume, ranks=ranks), "resumed")
    return folder, text


@pytest.mark.parametrize("ranks", [1, 2])
def test_accelerate_killed_after_a_save_and_resumed_is_audited_exact(tmp_path, ranks, capsys):
    folder, text = _acc_killed_and_resumed(tmp_path, ranks=ranks)
    (audit,) = _audits(folder)
    assert audit["verdict"] == "exact" and audit["step"] == 6 and audit["checked"] == 3, audit
    lines = _said(text)
    assert len(lines) == 1 and "from step 6: exact" in lines[0], text[-3000:]
    assert "Resume audit from step 6: exact: the 3 step(s) compared" in _report(folder, capsys)


def test_accelerate_resumed_in_another_data_order_is_told_it_diverged_at_the_next_step(tmp_path, capsys):
    folder, text = _acc_killed_and_resumed(tmp_path, "--no-skip")
    (audit,) = _audits(folder)
    assert audit["verdict"] == "diverged" and audit["at"] == 7 and audit["loss"] != audit["loss_was"], audit
    assert audit["lr"] == audit["lr_was"], audit
    lines = _said(text)
    assert len(lines) == 1 and "DIVERGED at step 7" in lines[0], text[-3000:]
    assert "DIVERGED at step 7" in _report(folder, capsys)


# ------------------------------------------------------------------------------------------ the Hugging Face Trainer
def _hf_killed_and_resumed(tmp_path: Path, *resume: str, ranks: int = 1) -> tuple[Path, str]:
    """A save every 4 steps; SIGKILLed as the save of step 8 returns, which is gone too; a fresh process resumes from
    step 4 with ``resume``'s flags."""
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    first = launch(str(TESTS / "hf_run.py"), str(run), "16", str(tmp_path / "first.pt"), "--sigkill-after-save", "8",
                   ranks=ranks, real=ranks > 1, timeout=300)
    assert first.returncode != 0, "the first run was to be killed after the save of step 8"
    recorded = [e for e in _events(run) if e["kind"] == "metrics"]
    assert [e["step"] for e in recorded] == [5, 6, 7], recorded
    assert all({"loss", "grad_norm", "lr"} <= set(e) for e in recorded), recorded
    shutil.rmtree(run / "checkpoint-8")
    text = _ok(launch(str(TESTS / "hf_run.py"), str(run), "16", str(tmp_path / "resumed.pt"), "--resume", *resume,
                      ranks=ranks, real=ranks > 1, timeout=300), "resumed")
    return run, text


def test_the_trainer_killed_after_a_save_and_resumed_is_audited_exact(tmp_path, capsys):
    run, text = _hf_killed_and_resumed(tmp_path)
    (audit,) = _audits(run)
    assert audit["verdict"] == "exact" and audit["step"] == 4 and audit["checked"] == 3, audit
    lines = _said(text)
    assert len(lines) == 1 and "from step 4: exact" in lines[0], text[-3000:]
    assert "Resume audit from step 4: exact" in _report(run, capsys)


def test_the_trainer_resumed_with_ignore_data_skip_is_told_it_diverged_naming_the_data(tmp_path, capsys):
    run, text = _hf_killed_and_resumed(tmp_path, "--ignore-data-skip")
    (audit,) = _audits(run)
    assert audit["verdict"] == "diverged" and audit["at"] == 5 and audit["causes"] == ["dataloader"], audit
    assert audit["loss"] != audit["loss_was"] and audit["lr"] == audit["lr_was"], audit
    lines = _said(text)
    assert len(lines) == 1 and "DIVERGED at step 5" in lines[0] and "data loader" in lines[0], text[-3000:]
    assert "DIVERGED at step 5" in _report(run, capsys)


# ------------------------------------------------------------------------------------------------------ Lightning
def _lit_ended_and_resumed(tmp_path: Path, *resume: str) -> tuple[Path, str]:
    """Two epochs of 8 steps, a save at the end of each (and ``last.ckpt``); a fresh process resumes from the save
    of step 8 with ``resume``'s flags."""
    pytest.importorskip("pytorch_lightning")
    run = tmp_path / "run"
    _ok(launch(str(TESTS / "lit_run.py"), str(run), "2", str(tmp_path / "first.pt"), timeout=300), "first run")
    recorded = [e for e in _events(run) if e["kind"] == "metrics"]
    assert [e["step"] for e in recorded] == [9, 10, 11], recorded
    assert all({"loss", "lr"} <= set(e) for e in recorded), recorded
    assert [e["step"] for e in _events(run) if e["kind"] == "save"] == [8, 8, 16, 16]  # each with last.ckpt
    text = _ok(launch(str(TESTS / "lit_run.py"), str(run), "2", str(tmp_path / "resumed.pt"), "--from",
                      "epoch=0-step=8.ckpt", *resume, timeout=300), "resumed")
    return run, text


def test_lightning_resumed_from_a_save_is_audited_exact(tmp_path, capsys):
    run, text = _lit_ended_and_resumed(tmp_path)
    (audit,) = _audits(run)
    assert audit["verdict"] == "exact" and audit["step"] == 8 and audit["checked"] == 3, audit
    lines = _said(text)
    assert len(lines) == 1 and "from step 8: exact" in lines[0], text[-3000:]
    assert "Resume audit from step 8: exact" in _report(run, capsys)


def test_lightning_resumed_on_other_data_is_told_it_diverged_at_the_next_step(tmp_path, capsys):
    run, text = _lit_ended_and_resumed(tmp_path, "--other-data")
    (audit,) = _audits(run)
    assert audit["verdict"] == "diverged" and audit["at"] == 9 and audit["causes"] == ["rng"], audit
    assert audit["loss"] != audit["loss_was"] and audit["lr"] == audit["lr_was"], audit
    lines = _said(text)
    assert len(lines) == 1 and "DIVERGED at step 9" in lines[0] and "Lightning saves none" in lines[0], text[-3000:]
    assert "DIVERGED at step 9" in _report(run, capsys)


# ------------------------------------------------------------------------------------------------------ the waits
def _on_disk_is_in_memory(folder: Path, audit) -> None:  # noqa: ANN001
    """The record on disk holds every event the integration's record has added so far (the metrics the record's
    thread writes in the background too)."""
    assert audit.record.events and _events(folder) == audit.record.events


def test_after_each_integrations_wait_the_record_on_disk_holds_every_event_so_far(tmp_path):
    """``wait_for_save``, ``ckptio_wait`` and ``CkptioCheckpointIO.wait`` return with the run's record on disk: the
    saves committed and the steps recorded after them, which the record's own thread writes in the background."""
    pytest.importorskip("accelerate")
    import torch
    from acc_tiny import accelerator

    from ckptio.accelerate import CkptioAccelerator

    acc = accelerator(CkptioAccelerator, tmp_path / "acc")
    model, opt = acc.prepare(torch.nn.Linear(4, 1), torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1))
    for step in range(1, 4):  # a save after step 1; step 2's metrics recorded at step 3's backward
        acc.backward(model(torch.ones(2, 4)).sum())
        opt.step()
        if step == 1:
            acc.save_state()
        if step > 1:
            acc.wait_for_save()
            _on_disk_is_in_memory(tmp_path / "acc", acc.ckptio_audit)
    assert [e["step"] for e in _events(tmp_path / "acc") if e["kind"] == "metrics"] == [2]
    acc.end_training()

    pytest.importorskip("transformers")
    from hf_tiny import trainer
    from transformers import TrainerCallback

    from ckptio.hf_trainer import CkptioTrainer

    class Check(TrainerCallback):
        def on_step_end(self, args, state, control, **kw) -> None:  # noqa: ANN001
            if state.global_step > 2:  # after the first save (a record is written once the run saved)
                tr.ckptio_wait()
                _on_disk_is_in_memory(tmp_path / "hf", tr.ckptio_audit)

    tr = trainer(CkptioTrainer, tmp_path / "hf", 5, save_steps=2)
    tr.add_callback(Check())
    tr.train()

    pytest.importorskip("pytorch_lightning")
    import lit_tiny
    import pytorch_lightning as pl

    from ckptio.lightning import CkptioCheckpointIO

    class LitCheck(pl.Callback):
        def on_train_batch_end(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            if io._audit is not None:
                io.wait()
                _on_disk_is_in_memory(tmp_path / "lit", io._audit)

    io = CkptioCheckpointIO()
    lit = lit_tiny.trainer(tmp_path / "lit", 1, [io], every_n_train_steps=2, save_top_k=-1)
    lit.callbacks.append(LitCheck())
    lit.fit(lit_tiny.Tiny(), lit_tiny.loader(n=24))
