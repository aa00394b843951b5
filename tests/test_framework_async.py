"""Background saves where the frameworks have none: ``CkptioTrainer(async_save=True)`` and
``CkptioAccelerator(async_save=True)``, with the real transformers Trainer and the real accelerate.

Proven here: the save is staged (training goes on while the write is held in flight, and the checkpoint holds the
states of the instant of the save, equal to the framework's own checkpoint of that step); a run killed during a
background write (held at a fault point, so it is surely in flight) and right after a save returns, then rerun,
ends bitwise equal to the framework's own uninterrupted run, on 1 process and on 2 ranks; the checkpoints kept are
the framework's; a failure of the background write is raised on the training thread, and on 2 ranks a failure of
rank 1's part keeps rank 0 from committing.
"""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from distributed import launch  # noqa: E402
from hf_tiny import run_names, state, trainer  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from ckptio import _faults  # noqa: E402
from ckptio.integrations.framework_async import WRITING  # noqa: E402
from ckptio.hf_trainer import CkptioTrainer, usable_checkpoints  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HF_RUN = str(ROOT / "tests" / "hf_run.py")
STEPS = 16
AsyncTrainer = functools.partial(CkptioTrainer, async_save=True)


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.fixture
def faults():
    yield _faults
    _faults.set_hook(None)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("straight")
    tr = trainer(Trainer, root, STEPS)
    tr.train()
    return state(tr), root


class _Seen(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step, self.event = step, threading.Event()

    def on_step_end(self, args, state, control, **kw) -> None:  # noqa: ANN001
        if state.global_step == self.step:
            self.event.set()


# ------------------------------------------------------------------------------------------- the Trainer
def test_trainer_async_save_is_staged_written_while_training_goes_on_and_equals_the_trainers(tmp_path, straight,
                                                                                            faults):
    """The first save's write is held at the fault point until training has done two more steps: the checkpoint
    still holds step 4's states (equal to the plain Trainer's checkpoint-4), and the run ends bitwise equal."""
    seen = _Seen(6)
    held = []

    def hold(name: str) -> None:
        if name == WRITING and not held:
            held.append(seen.event.wait(120))

    faults.set_hook(hold)
    ours = trainer(AsyncTrainer, tmp_path, STEPS)
    ours.add_callback(seen)
    ours.train()
    assert held == [True], "training did not go on while the first save was being written"
    _same(state(ours), straight[0], "async saves, uninterrupted")
    assert run_names(tmp_path) == run_names(straight[1]) == [f"checkpoint-{s}" for s in (4, 8, 12, 16)]
    for step in (4, 16):
        mine, theirs = tmp_path / f"checkpoint-{step}", straight[1] / f"checkpoint-{step}"
        assert (mine / "manifest.json").is_file()
        _same(load_file(mine / "model.safetensors"), load_file(theirs / "model.safetensors"), f"weights at {step}")
        a, b = (torch.load(p / "optimizer.pt", weights_only=True) for p in (mine, theirs))
        for i in b["state"]:
            _same(a["state"][i], b["state"][i], f"optimizer moments at {step}")
        assert torch.load(mine / "scheduler.pt", weights_only=True) == \
            torch.load(theirs / "scheduler.pt", weights_only=True)
    assert usable_checkpoints(tmp_path)[1] == []


@pytest.mark.parametrize("limit", [1, 2])
def test_trainer_async_keeps_the_checkpoints_the_trainer_keeps(tmp_path, limit):
    ends = {}
    for name, cls in (("plain", Trainer), ("async", AsyncTrainer)):
        tr = trainer(cls, tmp_path / name, 24, evaluate=True, save_total_limit=limit, metric_for_best_model="score",
                     greater_is_better=True, load_best_model_at_end=True)
        tr.train()
        ends[name] = (run_names(tmp_path / name), Path(tr.state.best_model_checkpoint).name, tr.state.best_metric,
                      {k: v.clone() for k, v in tr.model.state_dict().items()})
    assert ends["async"][:3] == ends["plain"][:3], (ends["async"][:3], ends["plain"][:3])
    _same(ends["async"][3], ends["plain"][3], "the best model loaded at the end")


def test_trainer_async_hands_frozen_weights_on_uncopied_and_still_saves_them(tmp_path):
    """A frozen parameter (an adapter's base weights) is written from the model, not copied at each save: the
    checkpoint equals the plain Trainer's with the same parameter frozen, and no staging buffer holds it."""
    ends = {}
    for name, cls in (("plain", Trainer), ("async", AsyncTrainer)):
        tr = trainer(cls, tmp_path / name, 8)
        tr.model.model.embed_tokens.weight.requires_grad_(False)
        tr.train()
        ends[name] = (state(tr), load_file(tmp_path / name / "checkpoint-8" / "model.safetensors"))
        if name == "async":
            buffers = tr._ckptio_saves._stager._buffers
            assert buffers and not [k for k in buffers if "embed_tokens" in k], sorted(buffers)[:3]
    _same(ends["async"][0], ends["plain"][0], "frozen embedding, end of the run")
    _same(ends["async"][1], ends["plain"][1], "frozen embedding, checkpoint-8")


def test_trainer_async_failure_is_raised_on_the_training_thread(tmp_path, faults):
    def fail(name: str) -> None:
        if name == WRITING:
            raise OSError(28, "No space left on device (injected)")

    faults.set_hook(fail)
    with pytest.raises(OSError, match="No space left") as info:
        trainer(AsyncTrainer, tmp_path, 8).train()
    assert any("background Trainer checkpoint save" in note for note in info.value.__notes__)
    # raised by the next save's wait, before it began: nothing committed, the first save's hidden folder left
    names = run_names(tmp_path)
    assert len(names) == 1 and names[0].startswith(".checkpoint-4.tmp-"), names


def _hf(*args: str, ranks: int = 1, ok: bool = True) -> str:
    done = launch(HF_RUN, *args, ranks=ranks)
    text = done.stdout + done.stderr
    if ok:
        assert done.returncode == 0, text[-4000:]
    else:
        assert done.returncode != 0 and not Path(args[2]).exists(), f"{args}: meant to stop early\n{text[-3000:]}"
    return text


def _trainer_kill_resume(root: Path, ranks: int) -> dict:
    """Killed (rank 0, SIGKILL) while its second save is written in the background; rerun and killed (every rank)
    right after its save of step 12 returns; rerun to the end."""
    _hf(str(root), str(STEPS), str(root / "x.pt"), "--async", "--kill-at", f"{WRITING}:2", ranks=ranks, ok=False)
    names = run_names(root)
    assert names[0] == "checkpoint-4" and len(names) == 2 and names[1].startswith(".checkpoint-8.tmp-"), names
    _hf(str(root), str(STEPS), str(root / "y.pt"), "--async", "--resume", "--sigkill-after-save", "12", ranks=ranks,
        ok=False)
    names = run_names(root)
    assert names[:2] == ["checkpoint-4", "checkpoint-8"] and len(names) == 3, names
    assert names[2] == "checkpoint-12" or names[2].startswith(".checkpoint-12.tmp-"), names
    assert usable_checkpoints(root)[1] == []  # whatever the kill cut, no torn folder under a checkpoint's name
    _hf(str(root), str(STEPS), str(root / "resumed.pt"), "--async", "--resume", ranks=ranks)
    assert run_names(root) == [f"checkpoint-{s}" for s in (4, 8, 12, 16)]
    return torch.load(root / "resumed.pt", weights_only=True)


@pytest.mark.slow
def test_trainer_async_killed_mid_write_and_after_a_save_resumes_bitwise_equal(tmp_path, straight):
    _same(_trainer_kill_resume(tmp_path, 1), straight[0], "1 process, async, killed twice -> resume")


@pytest.mark.slow
def test_trainer_async_two_ranks_killed_resumed_and_a_rank_1_failure_commits_nothing(tmp_path):
    _hf(str(tmp_path / "plain"), str(STEPS), str(tmp_path / "straight.pt"), "--plain", ranks=2)
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    _same(_trainer_kill_resume(tmp_path / "ours", 2), straight, "2 ranks, async, killed twice -> resume")
    # rank 1's part fails in the background: rank 0 does not commit, and both ranks raise at the next save
    text = _hf(str(tmp_path / "failed"), "8", str(tmp_path / "failed.pt"), "--async", "--fail-at", f"{WRITING}:1",
               ranks=2, ok=False)
    assert re.search(r"writing .*checkpoint-4 failed on rank\(s\) \[1\]", text), text[-3000:]
    assert "No space left on device (injected" in text
    names = run_names(tmp_path / "failed")
    assert len(names) == 1 and names[0].startswith(".checkpoint-4.tmp-"), names


# ------------------------------------------------------------------------------------------------ accelerate
ACC_RUN = str(ROOT / "tests" / "acc_run.py")


@pytest.fixture(scope="module")
def acc_straight(tmp_path_factory) -> tuple[dict, Path]:
    from acc_tiny import train
    from accelerate import Accelerator

    root = tmp_path_factory.mktemp("acc_straight")
    out = train(root, Accelerator)
    out.pop("main")
    return out, root


def _acc_names(root: Path) -> list[str]:
    return run_names(root / "checkpoints")


def test_accelerate_async_save_is_staged_written_while_training_goes_on_and_equals_accelerates(tmp_path,
                                                                                              acc_straight, faults):
    from acc_tiny import train

    from ckptio.accelerate import CkptioAccelerator

    went_on, held = threading.Event(), []

    def hold(name: str) -> None:
        if name == WRITING and not held:
            held.append(went_on.wait(120))

    faults.set_hook(hold)
    out = train(tmp_path, CkptioAccelerator, on_step=lambda done: went_on.set() if done == 5 else None,
                async_save=True)
    out.pop("main")
    assert held == [True], "training did not go on while the first save was being written"
    _same(out, acc_straight[0], "async saves, uninterrupted")
    assert _acc_names(tmp_path) == _acc_names(acc_straight[1]) == [f"checkpoint_{i}" for i in range(4)]
    for i in (0, 3):
        mine, theirs = (r / "checkpoints" / f"checkpoint_{i}" for r in (tmp_path, acc_straight[1]))
        assert (mine / "manifest.json").is_file()
        _same(load_file(mine / "model.safetensors"), load_file(theirs / "model.safetensors"), f"weights, {i}")
        a, b = (torch.load(p / "optimizer.bin", weights_only=True) for p in (mine, theirs))
        for k in b["state"]:
            _same(a["state"][k], b["state"][k], f"optimizer moments, {i}")
        a, b = (torch.load(p / "custom_checkpoint_0.pkl", weights_only=True) for p in (mine, theirs))
        assert a["n"] == b["n"] and torch.equal(a["total"], b["total"])


def test_accelerate_async_total_limit_keeps_what_accelerate_keeps(tmp_path):
    from acc_tiny import train
    from accelerate import Accelerator

    from ckptio.accelerate import CkptioAccelerator

    train(tmp_path / "plain", Accelerator, limit=2)
    train(tmp_path / "async", CkptioAccelerator, limit=2, async_save=True)
    assert _acc_names(tmp_path / "async") == _acc_names(tmp_path / "plain") == ["checkpoint_2", "checkpoint_3"]


def test_accelerate_async_failure_is_raised_on_the_training_thread(tmp_path, faults):
    from acc_tiny import train

    from ckptio.accelerate import CkptioAccelerator

    def fail(name: str) -> None:
        if name == WRITING:
            raise OSError(28, "No space left on device (injected)")

    faults.set_hook(fail)
    with pytest.raises(OSError, match="No space left") as info:
        train(tmp_path, CkptioAccelerator, async_save=True)
    assert any("background accelerate checkpoint save" in note for note in info.value.__notes__)
    names = _acc_names(tmp_path)
    assert len(names) == 1 and names[0].startswith(".checkpoint_0.tmp-"), names


def _acc(*args: str, ranks: int = 1, ok: bool = True) -> str:
    done = launch(ACC_RUN, *args, ranks=ranks)
    text = done.stdout + done.stderr
    if ok:
        assert done.returncode == 0, text[-4000:]
    else:
        assert done.returncode != 0 and not Path(args[1]).exists(), f"{args}: meant to stop early\n{text[-3000:]}"
    return text


def _acc_kill_resume(root: Path, ranks: int) -> dict:
    """Killed (rank 0, SIGKILL) while its second save (checkpoint_1) is written in the background; rerun and killed
    (every rank) right after step 9 and its save (checkpoint_2); rerun to the end."""
    text = _acc(str(root), str(root / "x.pt"), "--async", "--kill-at", f"{WRITING}:2", ranks=ranks, ok=False)
    assert not re.search(r"^(\[rank0\]: )?\w*Error\b", text, re.M), text[-3000:]
    names = _acc_names(root)
    assert names[0] == "checkpoint_0" and len(names) == 2 and names[1].startswith(".checkpoint_1.tmp-"), names
    _acc(str(root), str(root / "y.pt"), "--async", "--resume", "--sigkill-at", "9", ranks=ranks, ok=False)
    names = _acc_names(root)
    assert names[:2] == ["checkpoint_0", "checkpoint_1"] and len(names) == 3, names
    assert names[2] == "checkpoint_2" or names[2].startswith(".checkpoint_2.tmp-"), names
    from ckptio.accelerate import usable_checkpoints as acc_usable

    assert acc_usable(root / "checkpoints")[1] == []
    _acc(str(root), str(root / "resumed.pt"), "--async", "--resume", ranks=ranks)
    assert _acc_names(root) == [f"checkpoint_{i}" for i in range(4)]
    return torch.load(root / "resumed.pt", weights_only=True)


@pytest.mark.slow
def test_accelerate_async_killed_mid_write_and_after_a_save_resumes_bitwise_equal(tmp_path, acc_straight):
    _same(_acc_kill_resume(tmp_path, 1), acc_straight[0], "1 process, async, killed twice -> resume")


@pytest.mark.slow
def test_accelerate_async_two_ranks_killed_resumed_and_a_rank_1_failure_commits_nothing(tmp_path):
    _acc(str(tmp_path / "plain"), str(tmp_path / "straight.pt"), "--plain", ranks=2)
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    _same(_acc_kill_resume(tmp_path / "ours", 2), straight, "2 ranks, async, killed twice -> resume")
    text = _acc(str(tmp_path / "failed"), str(tmp_path / "failed.pt"), "--async", "--fail-at", f"{WRITING}:1",
                ranks=2, ok=False)
    assert re.search(r"writing .*checkpoint_0 failed on rank\(s\) \[1\]", text), text[-3000:]
    names = _acc_names(tmp_path / "failed")
    assert len(names) == 1 and names[0].startswith(".checkpoint_0.tmp-"), names
