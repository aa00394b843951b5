"""Retention and resume of ``CkptioCheckpointIO`` beside torn folders, with the real ``pytorch_lightning`` deciding.

Lightning's ``ModelCheckpoint`` counts and deletes by the paths it remembers, and ``fit(ckpt_path="last")`` takes the
``last*.ckpt`` entry modified last; neither looks inside. A *torn* folder here is one under a checkpoint's name with
no manifest (a copy cut short, a manifest lost). Proven: resume never starts from a torn folder (the newest complete
``last`` one is read instead, or ``NoUsableCheckpointError`` when there is none); a torn folder never takes one of
the ``save_top_k`` places; the plugin never deletes the checkpoint it just wrote nor the newest complete one, and
says so naming it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from lit_tiny import Tiny, fit, loader, same  # noqa: E402

from ckptio import NoUsableCheckpointError  # noqa: E402
from ckptio.lightning import CkptioCheckpointIO, last_checkpoint, read_checkpoint, write_checkpoint  # noqa: E402

EPOCHS = 4


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    return fit(tmp_path_factory.mktemp("straight"), EPOCHS)


def _torn_copy(src: Path, dst: Path) -> Path:
    """``src`` copied to ``dst`` without its manifest, modified after everything else (what Lightning ranks by)."""
    shutil.copytree(src, dst)
    (dst / "manifest.json").unlink()
    later = time.time() + 60
    os.utime(dst, (later, later))
    return dst


def _complete(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if (p / "manifest.json").is_file() and not p.name.startswith(".")}


def test_resume_from_last_skips_a_torn_last_folder_naming_it(tmp_path, straight, caplog):
    """The torn ``last-v1.ckpt`` is the one Lightning picks (modified last); the run resumes from the complete
    ``last.ckpt`` instead and ends bitwise equal to the uninterrupted run."""
    fit(tmp_path, 2, [CkptioCheckpointIO()], save_last=True)
    torn = _torn_copy(tmp_path / "last.ckpt", tmp_path / "last-v1.ckpt")
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        resumed = fit(tmp_path, EPOCHS, [CkptioCheckpointIO()], ckpt_path="last", save_last=True)
    same(resumed, straight, "resumed beside a torn last-v1.ckpt")
    assert "last-v1.ckpt" in caplog.text and "skipping" in caplog.text, caplog.text
    assert torn.is_dir() and read_checkpoint(tmp_path / "last.ckpt")["global_step"] == 8 * EPOCHS
    assert last_checkpoint(tmp_path) == str(tmp_path / "last.ckpt")


def test_resume_with_only_a_torn_last_folder_raises_no_usable_checkpoint(tmp_path):
    fit(tmp_path / "run", 1, [CkptioCheckpointIO()], save_last=True)
    _torn_copy(tmp_path / "run" / "last.ckpt", tmp_path / "last.ckpt")
    with pytest.raises(NoUsableCheckpointError, match="last.ckpt"):
        fit(tmp_path, 2, [CkptioCheckpointIO()], ckpt_path="last", save_last=True)


def test_last_checkpoint_finds_lightnings_versioned_last(tmp_path):
    """Lightning's version counter names a second ``last`` ``last-v1.ckpt``; ``last_checkpoint`` (the S3 resume helper)
    considers the names Lightning's ``ckpt_path="last"`` does."""
    write_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, tmp_path / "last.ckpt")
    time.sleep(0.05)
    write_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 5}, tmp_path / "last-v1.ckpt")
    assert last_checkpoint(tmp_path) == str(tmp_path / "last-v1.ckpt")
    _torn_copy(tmp_path / "last.ckpt", tmp_path / "last-v2.ckpt")
    assert last_checkpoint(tmp_path) == str(tmp_path / "last-v1.ckpt")


def test_a_torn_folder_never_takes_a_top_k_place(tmp_path):
    """``save_top_k=2``: the best kept checkpoint is torn between the runs. Lightning, resumed, would still count it
    as one of the two kept and delete a complete one for the next better score; the plugin hands it a state that no
    longer lists the torn one, so two complete checkpoints stay."""
    kwargs = dict(monitor="train_loss", mode="min", save_top_k=2, save_last=True, every_n_epochs=None,
                  every_n_train_steps=3)
    fit(tmp_path, 2, [CkptioCheckpointIO()], **kwargs)
    state = read_checkpoint(tmp_path / "last.ckpt")["callbacks"]
    (mc,) = [v for k, v in state.items() if k.startswith("ModelCheckpoint")]
    assert len(mc["best_k_models"]) == 2
    best = Path(mc["best_model_path"])
    (best / "manifest.json").unlink()
    fit(tmp_path, EPOCHS, [CkptioCheckpointIO()], ckpt_path="last", **kwargs)
    kept = _complete(tmp_path) - {"last.ckpt"}
    assert len(kept) == 2 and best.is_dir() and best.name not in kept, sorted(kept)


class _Crash(pl.Callback):
    def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001
        if trainer.global_step == 12:
            raise RuntimeError("crash at step 12")


def test_the_newest_complete_checkpoint_is_never_deleted(tmp_path, caplog):
    """``OnExceptionCheckpoint`` saves ``on_exception.ckpt`` when a fit fails and deletes it at the end of the next
    stage that ends well. A resumed fit that ends before its next save would delete the newest complete checkpoint
    (step 12; the other holds step 8): the plugin refuses, naming it. (With ``save_last`` the resumed fit writes a
    newer ``last.ckpt`` at the end of its epoch, and the deletion goes ahead.)"""
    def trainer(epochs: int, *extra: pl.Callback) -> pl.Trainer:
        return pl.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          accelerator="cpu", devices=1, plugins=[CkptioCheckpointIO()], deterministic=True,
                          callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_epochs=5, save_top_k=-1),
                                     pl.callbacks.OnExceptionCheckpoint(tmp_path), *extra])

    torch.manual_seed(0)
    write_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 8}, tmp_path / "epoch=0-step=8.ckpt")
    with pytest.raises(RuntimeError, match="crash at step 12"):
        trainer(2, _Crash()).fit(Tiny(), loader())
    crash = tmp_path / "on_exception.ckpt"
    assert read_checkpoint(crash)["global_step"] == 12
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        trainer(2).fit(Tiny(), loader(), ckpt_path=str(crash))  # ends at step 16, every_n_epochs=5: no save
    assert crash.is_dir() and read_checkpoint(crash)["global_step"] == 12
    assert f"not deleting {crash}" in caplog.text and "newest complete" in caplog.text, caplog.text


def test_the_checkpoint_just_written_is_never_deleted(tmp_path, caplog):
    io = CkptioCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / "a.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 2}, tmp_path / "b.ckpt")
    os.utime(tmp_path / "a.ckpt" / "manifest.json", (time.time() + 60,) * 2)  # a.ckpt looks newer
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        io.remove_checkpoint(tmp_path / "b.ckpt")
    assert (tmp_path / "b.ckpt" / "manifest.json").is_file()
    assert "b.ckpt: it is the checkpoint just written" in caplog.text, caplog.text
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, tmp_path / "c.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")  # no longer the one just written, nor the newest: removed
    assert not (tmp_path / "b.ckpt").exists()


def test_on_whole_second_timestamps_the_checkpoint_written_last_is_the_newest(tmp_path):
    """Two folders committed within the same recorded second: the older one is still Lightning's to delete."""
    io = CkptioCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / "z.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 2}, tmp_path / "a.ckpt")
    second = int(time.time())
    for name in ("z.ckpt", "a.ckpt"):
        os.utime(tmp_path / name / "manifest.json", (second, second))
    io.remove_checkpoint(tmp_path / "z.ckpt")
    assert not (tmp_path / "z.ckpt").exists() and (tmp_path / "a.ckpt" / "manifest.json").is_file()


def test_a_missing_last_path_is_reported_as_missing(tmp_path):
    from ckptio import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match="last.ckpt"):
        CkptioCheckpointIO().load_checkpoint(tmp_path / "nowhere" / "last.ckpt")
