"""Saving on preemption in the framework integrations (issue 68), with the real frameworks in processes of their own.

Each run is a tiny model trained a few steps; SIGTERM reaches it mid-step (every rank, or one rank alone). Proven
for each framework: the step the signal came in is committed on every rank, a rerun resumes from it and ends
bitwise equal to the run never stopped, and the handler that was there before ckptio's (the framework's own, or one
the script installed first) still ran.
"""

from __future__ import annotations

import functools
import importlib.util
import signal
from pathlib import Path

import pytest
import torch

from distributed import launch

ROOT = Path(__file__).resolve().parents[1]


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _ok(done, what: str) -> str:
    text = done.stdout + done.stderr
    assert done.returncode == 0, f"{what}:\n{text[-4000:]}"
    return text


# ------------------------------------------------------------------------------------------ the Hugging Face Trainer
HF_STEPS = 16


def _hf(*args: str, ranks: int, real: bool = False) -> str:
    return _ok(launch(str(ROOT / "tests" / "hf_run.py"), *args, ranks=ranks, real=real), " ".join(args))


@pytest.mark.slow
@pytest.mark.parametrize("ranks, mode, whom", [(1, "exit", ""), (2, "return", ":1")])
def test_the_trainer_saves_the_step_the_signal_came_in_and_resumes_from_it_bitwise(tmp_path, ranks, mode, whom):
    pytest.importorskip("transformers")
    from ckptio.hf_trainer import last_checkpoint

    _hf(str(tmp_path / "straight"), str(HF_STEPS), str(tmp_path / "straight.pt"), ranks=ranks)
    root = tmp_path / "run"
    text = _hf(str(root), str(HF_STEPS), str(tmp_path / "x.pt"), "--on-preemption", mode, "--sigterm-in", "7" + whom,
               "--own-handler", ranks=ranks, real=ranks > 1)  # 2 ranks: under the real torchrun
    assert not (tmp_path / "x.pt").exists(), "the run went on after the signal"
    assert f"own handler ran on rank {whom[1:] or 0}" in text, "the handler there before ckptio's did not run"
    if mode == "return":  # train() returned on every rank, at the same step
        assert all(f"rank {r} preempted at 7" in text for r in range(ranks)), text[-3000:]
    assert sorted(p.name for p in root.iterdir()) == [".ckptio_record.json", "checkpoint-4", "checkpoint-7"]
    assert last_checkpoint(root) == root / "checkpoint-7"  # committed: its manifest checks
    assert {f"rng_state_{r}.pth" for r in range(ranks)} <= {p.name for p in (root / "checkpoint-7").iterdir()} \
        or ranks == 1
    _hf(str(root), str(HF_STEPS), str(tmp_path / "resumed.pt"), "--resume", ranks=ranks)
    _same(torch.load(tmp_path / "resumed.pt", weights_only=True),
          torch.load(tmp_path / "straight.pt", weights_only=True), f"{ranks} rank(s): preempted at 7, resumed")


# ------------------------------------------------------------------------------------------------------ accelerate
def _acc(*args: str, ranks: int, real: bool = False) -> str:
    return _ok(launch(str(ROOT / "tests" / "acc_run.py"), *args, ranks=ranks, real=real), " ".join(args))


@pytest.mark.slow
@pytest.mark.parametrize("ranks, mode, whom", [(1, "exit", ""), (2, "return", ":1")])
def test_accelerate_saves_the_step_the_signal_came_in_and_resumes_from_it_bitwise(tmp_path, ranks, mode, whom):
    """A save every 3 steps (checkpoint_0 at 3, checkpoint_1 at 6); SIGTERM after step 7's compute: the loop's
    ``save_on_preemption`` at the end of step 7 commits checkpoint_2 on every process."""
    pytest.importorskip("accelerate")
    from ckptio.accelerate import usable_checkpoints

    _acc(str(tmp_path / "straight"), str(tmp_path / "straight.pt"), ranks=ranks)
    root = tmp_path / "run"
    text = _acc(str(root), str(tmp_path / "x.pt"), "--on-preemption", mode, "--sigterm-at", "7" + whom,
                "--own-handler", ranks=ranks, real=ranks > 1)  # 2 ranks: under the real torchrun
    assert not (tmp_path / "x.pt").exists(), "the run went on after the signal"
    assert f"own handler ran on rank {whom[1:] or 0}" in text, "the handler there before ckptio's did not run"
    if mode == "return":
        assert all(f"rank {r} preempted at 7" in text for r in range(ranks)), text[-3000:]
    good, skipped = usable_checkpoints(root / "checkpoints")
    assert [p.name for p in good] == ["checkpoint_2", "checkpoint_1", "checkpoint_0"] and not skipped, (good, skipped)
    assert {f"random_states_{r}.pkl" for r in range(ranks)} <= {p.name for p in good[0].iterdir()}
    _acc(str(root), str(tmp_path / "resumed.pt"), "--resume", ranks=ranks)
    _same(torch.load(tmp_path / "resumed.pt", weights_only=True),
          torch.load(tmp_path / "straight.pt", weights_only=True), f"{ranks} process(es): preempted at 7, resumed")


# ------------------------------------------------------------------------------------------------------- Lightning
LIT_EPOCHS = 4  # 8 batches an epoch on 1 rank, 4 on 2; ModelCheckpoint saves every epoch


def _lit(*args: str, ranks: int, real: bool = False) -> str:
    ddp = ("--ddp",) if ranks > 1 else ()
    return _ok(launch(str(ROOT / "tests" / "lit_run.py"), *args, *ddp, ranks=ranks, real=real, timeout=300),
               " ".join(args))


@pytest.mark.slow
@pytest.mark.parametrize("ranks, preemption, whom", [(1, "exit", ""), (2, "exit", ""), (2, "exit", ":1"),
                                                     (2, "return", ":0"), (1, "return:SIGUSR1", "")])
def test_lightning_saves_the_step_the_signal_came_in_and_resumes_from_it_bitwise(tmp_path, ranks, preemption, whom):
    """The signal comes mid-step 8 (the last batch of epoch 0 on 1 rank, of epoch 1 on 2, before the epoch's own
    save), to every rank or (``whom``) to one alone: ``last.ckpt`` of step 8 is committed on every rank; Lightning's
    own handler still ran, on every rank together (its log, and its end of ``fit`` on SIGTERM: with ``"return"`` too,
    as ckptio warns) and so did the script's own; ``fit(ckpt_path="last")`` resumes from it and ends bitwise equal
    to the run never stopped. (Mid-epoch, Lightning resumes exactly only with a resumable data loader, whoever
    writes the checkpoint: it warns so; this loader is not.)"""
    pytest.importorskip("pytorch_lightning")
    from ckptio.lightning import last_checkpoint, read_checkpoint

    _lit(str(tmp_path / "straight"), str(LIT_EPOCHS), str(tmp_path / "straight.pt"), ranks=ranks)
    root = tmp_path / "run"
    text = _lit(str(root), str(LIT_EPOCHS), str(tmp_path / "x.pt"), "--on-preemption", preemption, "--signal-in",
                "8" + whom, "--own-handler", ranks=ranks, real=ranks > 1)  # 2 ranks: under the real torchrun
    assert not (tmp_path / "x.pt").exists(), "the run went on after the signal"
    assert all(f"own handler ran on rank {r}" in text for r in range(ranks)), "the handler before ckptio's did not run"
    if preemption == "exit" and ranks > 1:  # ckptio ended the process: with no group left for the teardown to abort on
        assert text.count("process group at exit: gone") == ranks and "at exit: up" not in text, text[-3000:]
    if whom:
        assert f"SIGTERM received (on {'this' if whom == ':0' else 'another'} rank); saved step 8" in text, text[-3000:]
    if preemption == "return":
        assert "Lightning ends fit on SIGTERM itself" in text, text[-3000:]
    if not preemption.endswith("SIGUSR1"):
        assert text.count("Received SIGTERM") == ranks, "Lightning's own handler did not run on every rank"
    else:  # fit returned on the step it saved
        assert "rank 0 preempted at 8" in text, text[-3000:]
    assert read_checkpoint(root / "last.ckpt")["global_step"] == 8  # committed: every byte checks
    if not preemption.endswith("SIGUSR1"):
        assert Path(last_checkpoint(root)) == root / "last.ckpt"
    else:  # fit went on to its own end of training, where ModelCheckpoint saved the same step again beside ours
        assert read_checkpoint(last_checkpoint(root))["global_step"] == 8
    _lit(str(root), str(LIT_EPOCHS), str(tmp_path / "resumed.pt"), "--resume", ranks=ranks)
    _same(torch.load(tmp_path / "resumed.pt", weights_only=True),
          torch.load(tmp_path / "straight.pt", weights_only=True), f"{ranks} rank(s): preempted at 8, resumed")


# --------------------------------------------------------------------------------------- in here: settings, handlers
@pytest.mark.parametrize("settings, words", [
    (dict(on_preemption="stop"), ["on_preemption", "stop"]),
    (dict(on_preemption="exit", preemption_signals=["SIGKILL"]), ["preemption_signals", "SIGKILL"]),
])
def test_bad_settings_name_the_field_in_every_integration(tmp_path, settings, words):
    from ckptio.errors import ConfigError

    makers = []
    if importlib.util.find_spec("accelerate"):
        from ckptio.accelerate import CkptioAccelerator

        makers.append(lambda: CkptioAccelerator(cpu=True, **settings))
    if importlib.util.find_spec("pytorch_lightning"):
        from ckptio.lightning import CkptioPreemption

        makers.append(lambda: CkptioPreemption(**settings))
    if importlib.util.find_spec("transformers"):
        from hf_tiny import trainer

        from ckptio.hf_trainer import CkptioTrainer

        makers.append(lambda: trainer(functools.partial(CkptioTrainer, **settings), tmp_path, 4))
    assert makers
    for make in makers:
        with pytest.raises(ConfigError) as err:
            make()
        assert all(w in str(err.value) for w in words), str(err.value)


def test_a_run_without_a_signal_saves_nothing_more_and_gives_the_handlers_back(tmp_path):
    """Lightning (its own handler comes and goes during fit) and the Trainer: after a run ckptio's handler is gone
    and the one the script had is back; the checkpoints are the usual ones."""
    mine = signal.signal(signal.SIGTERM, lambda *_: None)
    before = signal.getsignal(signal.SIGTERM)
    try:
        if importlib.util.find_spec("pytorch_lightning"):
            from lit_tiny import Tiny, loader, trainer as lit_trainer

            from ckptio.lightning import CkptioCheckpointIO, CkptioPreemption

            tr = lit_trainer(tmp_path / "lit", 1, [CkptioCheckpointIO()])
            tr.callbacks.append(CkptioPreemption("exit"))
            tr.fit(Tiny(), loader())
            assert signal.getsignal(signal.SIGTERM) is before
            assert sorted(p.name for p in (tmp_path / "lit").iterdir()) == [".ckptio_record.json", "epoch=0-step=8.ckpt"]
        if importlib.util.find_spec("transformers"):
            from hf_tiny import trainer as hf_trainer

            from ckptio.hf_trainer import CkptioTrainer

            tr = hf_trainer(functools.partial(CkptioTrainer, on_preemption="return"), tmp_path / "hf", 4)
            tr.train()
            assert signal.getsignal(signal.SIGTERM) is before and not tr.ckptio_preemption.preempted
            assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [".ckptio_record.json", "checkpoint-4"]
    finally:
        signal.signal(signal.SIGTERM, mine)
