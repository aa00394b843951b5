"""Each save's numbers reach the frameworks' own loggers under ``ckpt/``: Lightning's loggers (read back from its
real ``CSVLogger``), the HF Trainer's ``log`` (its ``log_history`` and a ``TrainerCallback.on_log``), accelerate's
``log`` (a real ``GeneralTracker`` given to ``log_with``); and to a plain listener, also for background saves."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from ckptio.integrations.save_numbers import SaveNumbers, as_metrics

KEYS = {"ckpt/blocked_s", "ckpt/total_s", "ckpt/bytes", "ckpt/files", "ckpt/step"}


def _sane(metrics: dict, step: int | None = None) -> None:
    assert KEYS <= set(metrics), metrics
    assert 0 < metrics["ckpt/blocked_s"] <= metrics["ckpt/total_s"] + 1e-9, metrics
    assert metrics["ckpt/bytes"] > 1000 and metrics["ckpt/files"] >= 2, metrics
    if step is not None:
        assert metrics["ckpt/step"] == step, metrics


def test_a_background_saves_blocked_time_is_what_returned_not_the_whole_save(tmp_path):
    import threading
    import time

    numbers, seen = SaveNumbers(), []
    numbers.listeners.append(seen.append)
    numbers.listeners.append(lambda event: 1 / 0)  # a failing listener is logged, never raised
    (tmp_path / "f").write_bytes(b"x" * 5000)
    (tmp_path / "g").write_bytes(b"y" * 10)
    timer = numbers.start(step=7, folder=tmp_path)
    returned = threading.Event()  # the background part ends only after the call returned, however loaded the machine
    commit = timer.wrap(lambda: (returned.wait(30), time.sleep(0.2)), background=True)
    thread = threading.Thread(target=commit)
    thread.start()
    timer.returned()
    returned.set()
    thread.join()
    (metrics,) = numbers.drain()
    _sane(metrics, 7)
    assert metrics["ckpt/total_s"] >= metrics["ckpt/blocked_s"] + 0.2 and metrics["ckpt/bytes"] == 5010
    assert seen[0]["kind"] == "save" and as_metrics(seen[0]) == metrics and numbers.drain() == []


@pytest.mark.parametrize("async_save", [False, True])
def test_lightning_logs_each_save_to_its_loggers(tmp_path, async_save):
    pl = pytest.importorskip("pytorch_lightning")
    from lit_tiny import Tiny, loader

    from ckptio.lightning import CkptioCheckpointIO, CkptioMetrics

    io, heard = CkptioCheckpointIO(async_save=async_save), []
    io.numbers.listeners.append(heard.append)
    torch.manual_seed(0)
    tr = pl.Trainer(max_steps=12, logger=pl.loggers.CSVLogger(str(tmp_path / "logs"), name="run"),
                    enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                    log_every_n_steps=1, plugins=[io],
                    callbacks=[CkptioMetrics(), pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"),
                                                                             every_n_train_steps=4, save_top_k=-1)])
    tr.fit(Tiny(), loader())
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    logged = [{k: float(v) for k, v in row.items() if k.startswith("ckpt/") and v} for row in rows]
    logged = [m for m in logged if m]
    assert [m["ckpt/step"] for m in logged] == [4, 8, 12], logged
    for m in logged:
        _sane(m)
    assert [e["step"] for e in heard] == [4, 8, 12]
    if async_save:  # the writes ran in the background: the loop waited for the copy only
        assert all(e["blocked_s"] < e["total_s"] for e in heard), heard


@pytest.mark.parametrize("async_save", [False, True])
def test_the_trainer_logs_each_save(tmp_path, async_save):
    pytest.importorskip("transformers")
    from hf_tiny import trainer
    from transformers import TrainerCallback

    from ckptio.hf_trainer import CkptioTrainer

    class Heard(TrainerCallback):
        def __init__(self) -> None:
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    heard = Heard()
    import functools

    tr = trainer(functools.partial(CkptioTrainer, async_save=async_save), tmp_path, 8, save_steps=4)
    tr.add_callback(heard)
    tr.train()
    from_history = [e for e in tr.state.log_history if "ckpt/blocked_s" in e]
    assert [e["ckpt/step"] for e in from_history] == [4, 8], tr.state.log_history
    for entry in from_history:
        _sane(entry)
    assert [e["ckpt/step"] for e in heard.logs if "ckpt/step" in e] == [4, 8]


def test_accelerate_logs_each_save_to_its_trackers(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.tracking import GeneralTracker
    from acc_tiny import accelerator

    from ckptio.accelerate import CkptioAccelerator

    class Tracker(GeneralTracker):
        name, requires_logging_directory, main_process_only = "kept", False, True

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[dict, int]] = []

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kw):
            self.logged.append((dict(values), step))

    for async_save in (False, True):
        tracker = Tracker()
        acc = accelerator(CkptioAccelerator, tmp_path / str(async_save), log_with=[tracker], async_save=async_save)
        acc.init_trackers("run")
        model = acc.prepare(torch.nn.Linear(64, 64))
        acc.register_for_checkpointing(acc.prepare(torch.optim.AdamW(model.parameters())))
        for _ in range(3):
            acc.save_state()
        acc.end_training()
        assert [step for _m, step in tracker.logged] == [0, 1, 2], tracker.logged
        for metrics, step in tracker.logged:
            _sane(metrics, step)


def test_a_background_save_that_commits_before_save_returns_lasted_till_the_return(tmp_path):
    """A small background save can commit before ``save()`` has returned (the accelerate test failed on it, the
    loop waiting 7.7 ms for a commit of 6.5): the save's total is then the time till the return, never less than
    what the loop waited."""
    import threading
    import time

    from ckptio.integrations.save_numbers import SaveNumbers

    numbers = SaveNumbers()
    heard: list[dict] = []
    numbers.listeners.append(heard.append)
    timer = numbers.start(step=3, folder=tmp_path)
    commit = timer.wrap(lambda: None, background=True)
    thread = threading.Thread(target=commit)
    thread.start()
    time.sleep(0.05)  # committed; the training thread not yet given back
    timer.returned()
    thread.join()
    (event,) = heard
    assert event["blocked_s"] >= 0.05 and event["total_s"] >= event["blocked_s"], event
