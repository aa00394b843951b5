"""accelerate's save_state / load_state through ckptio (``CkptioAccelerator``), with the real accelerate.

What a user changes is the class: ``CkptioAccelerator(...)`` for ``Accelerator(...)``. Proven here: the folder is
accelerate's (the plain ``Accelerator.load_state`` reads it) plus a manifest, committed whole; ``load_state()``
takes the newest complete checkpoint and sets the iteration counter after it; a run stopped and resumed ends
bitwise equal to the run uninterrupted, registered objects included; ``total_limit`` deletes only after the new
checkpoint is in place; the plain Accelerator's folders load; damaged, torn and hostile folders are refused.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from acc_tiny import STEPS, Counter, accelerator, train  # noqa: E402
from distributed import launch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from ckptio import CheckpointCorruptError, NoUsableCheckpointError  # noqa: E402
from ckptio.accelerate import CkptioAccelerator, usable_checkpoints  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(ROOT / "tests" / "acc_run.py")


def _run(root: Path, cls: type, stop: int = STEPS, resume: bool = False, limit: int | None = None) -> dict:
    out = train(root, cls, stop=stop, resume=resume, limit=limit)
    out.pop("main")
    return out


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("straight"), Accelerator)


def test_stopped_and_resumed_ends_bitwise_equal_with_committed_folders(tmp_path, straight):
    _run(tmp_path, CkptioAccelerator, stop=7)  # saves after steps 3 and 6
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint_0", "checkpoint_1"]
    manifest = json.loads((ckpts / "checkpoint_1" / "manifest.json").read_text())
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "custom_checkpoint_0.pkl"} <= set(manifest["files"])
    _same(_run(tmp_path, CkptioAccelerator, resume=True), straight, "ckptio -> ckptio")
    # the iteration counter went on after checkpoint_1: no number reused, nothing overwritten
    assert sorted(p.name for p in ckpts.iterdir()) == [f"checkpoint_{i}" for i in range(4)]


def test_the_plain_accelerators_folders_load_and_it_loads_ours(tmp_path, straight):
    _run(tmp_path / "theirs", Accelerator, stop=7)
    _same(_run(tmp_path / "theirs", CkptioAccelerator, resume=True), straight, "accelerate -> ckptio")
    _run(tmp_path / "ours", CkptioAccelerator, stop=7)
    _same(_run(tmp_path / "ours", Accelerator, resume=True), straight, "ckptio -> accelerate")


def test_load_takes_the_newest_complete_checkpoint(tmp_path, straight, caplog):
    _run(tmp_path, CkptioAccelerator, stop=9)
    ckpts = tmp_path / "checkpoints"
    opt = ckpts / "checkpoint_2" / "optimizer.bin"
    data = bytearray(opt.read_bytes())
    data[len(data) // 2] ^= 0x01
    opt.write_bytes(bytes(data))
    (ckpts / "checkpoint_3").mkdir()  # a plain save cut short
    (ckpts / "checkpoint_4").symlink_to(ckpts / "checkpoint_1")
    good, skipped = usable_checkpoints(ckpts)
    assert [p.name for p in good] == ["checkpoint_1", "checkpoint_0"] and len(skipped) == 3
    _same(_run(tmp_path, CkptioAccelerator, resume=True), straight, "resumed past damaged, torn and linked")
    assert "skipping checkpoint_2" in caplog.text


def test_total_limit_deletes_only_committed_and_after_the_new_one(tmp_path):
    _run(tmp_path, CkptioAccelerator, limit=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_3"]


def test_hostile_registered_state_and_nothing_usable_are_refused(tmp_path, capsys):
    class Boom:
        def __reduce__(self):  # noqa: ANN204
            return (print, ("pwned",))

    _run(tmp_path, Accelerator, stop=3)  # the plain Accelerator's folder: no manifest
    custom = tmp_path / "checkpoints" / "checkpoint_0" / "custom_checkpoint_0.pkl"
    torch.save({"n": Boom()}, custom)
    with pytest.raises(CheckpointCorruptError, match="custom_checkpoint_0.pkl"):
        _run(tmp_path, CkptioAccelerator, resume=True)
    assert "pwned" not in capsys.readouterr().out
    custom.write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CheckpointCorruptError, match="custom_checkpoint_0.pkl"):
        _run(tmp_path, CkptioAccelerator, resume=True)
    model = tmp_path / "checkpoints" / "checkpoint_0" / "model.safetensors"
    model.rename(tmp_path / "model.safetensors")
    model.symlink_to(tmp_path / "model.safetensors")  # accelerate's own reader would follow it
    with pytest.raises(NoUsableCheckpointError, match="a link or special file"):
        _run(tmp_path, CkptioAccelerator, resume=True)
    (tmp_path / "checkpoints" / "checkpoint_0" / "random_states_0.pkl").unlink()
    with pytest.raises(NoUsableCheckpointError, match="checkpoint_0"):
        _run(tmp_path, CkptioAccelerator, resume=True)
    assert "pwned" not in capsys.readouterr().out


def _launch(*args: str, ranks: int = 1, ok: bool = True) -> None:
    """``tests/acc_run.py`` in a process of its own (``ranks=1``) or under torchrun; ``ok=False``: it must stop
    before its end (SIGTERM or SIGKILL), writing no result."""
    done = launch(RUNNER, *args, ranks=ranks)
    if ok:
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    else:  # stopped by the signal it was given, not by an error (rank 1 may fail on rank 0's death: not counted)
        text = done.stdout + done.stderr
        assert not Path(args[1]).exists() and not re.search(r"^(\[rank0\]: )?\w*Error\b", text, re.M), text[-4000:]
        assert done.returncode in (-9, -15) or "Signal 9 (SIGKILL)" in text or "Signal 15 (SIGTERM)" in text, \
            text[-4000:]


def _names(root: Path) -> list[str]:
    return sorted((p.name for p in (root / "checkpoints").iterdir()), key=lambda n: (n.startswith("."), len(n), n))


def _preempt_kill_resume(root: Path, ranks: int) -> dict:
    """SIGTERM after step 7 (checkpoint_1, step 6, is the newest), then a rerun SIGKILLed while its second save
    (checkpoint_3, step 12) is written and not yet in place, then a rerun to the end."""
    _launch(str(root), str(root / "x.pt"), "--sigterm-at", "7", ranks=ranks, ok=False)
    assert _names(root) == ["checkpoint_0", "checkpoint_1"]
    _launch(str(root), str(root / "y.pt"), "--resume", "--kill-at", "commit.before_rename:2", ranks=ranks, ok=False)
    names = _names(root)
    assert names[:3] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"] and \
        names[3].startswith(".checkpoint_3.tmp-"), names
    _launch(str(root), str(root / "resumed.pt"), "--resume", ranks=ranks)
    assert _names(root) == [f"checkpoint_{i}" for i in range(4)]  # the killed save's leftover swept
    return torch.load(root / "resumed.pt", weights_only=True)


@pytest.mark.slow
def test_preempted_and_killed_mid_save_then_resumed_ends_bitwise_equal(tmp_path, straight):
    _same(_preempt_kill_resume(tmp_path, 1), straight, "1 process, SIGTERM + SIGKILL -> resume")


@pytest.mark.slow
def test_two_ranks_preempted_killed_resumed_adopted_and_resumed_on_one(tmp_path):
    _launch(str(tmp_path / "plain"), str(tmp_path / "straight.pt"), "--plain", ranks=2)
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    _same(_preempt_kill_resume(tmp_path / "ours", 2), straight, "2 ranks, SIGTERM + SIGKILL -> resume")
    # the plain Accelerator's 2-rank folders (random_states_0/1.pkl) resume under ckptio on 2 ranks
    shutil.rmtree(tmp_path / "plain" / "checkpoints" / "checkpoint_3")
    _launch(str(tmp_path / "plain"), str(tmp_path / "adopted.pt"), "--resume", ranks=2)
    _same(torch.load(tmp_path / "adopted.pt", weights_only=True), straight, "2 ranks, plain accelerate -> ckptio")
    # another number of processes: the 2-rank checkpoint_3 loads on 1 (random_states_0.pkl is this process's)
    acc = accelerator(CkptioAccelerator, tmp_path / "ours")
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    acc.register_for_checkpointing(Counter())
    assert acc.load_state().endswith("checkpoint_3")
    saved = load_file(tmp_path / "ours" / "checkpoints" / "checkpoint_3" / "model.safetensors")
    _same(dict(model.state_dict()), saved, "2 ranks -> 1 process, restored weights")
    assert acc.project_configuration.iteration == 4


def test_the_example_trains_and_resumes(tmp_path):
    script = ROOT / "examples" / "accelerate" / "train.py"
    for steps in (10, 20):
        done = launch(str(script), "--dir", str(tmp_path), "--steps", str(steps), timeout=300)
        assert done.returncode == 0 and f"trained to step {steps}" in done.stdout, done.stderr[-2000:]
    assert _names(tmp_path) == ["checkpoint_2", "checkpoint_3"]  # total_limit=2
    assert (tmp_path / "checkpoints" / "checkpoint_3" / "manifest.json").is_file()
