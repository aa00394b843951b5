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
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration  # noqa: E402

from ckptio import CheckpointCorruptError, NoUsableCheckpointError  # noqa: E402
from ckptio.accelerate import CkptioAccelerator, usable_checkpoints  # noqa: E402

STEPS, EVERY = 12, 3


class Counter:
    """A registered object: how many batches were seen, and their running sum."""

    def __init__(self) -> None:
        self.n, self.total = 0, torch.zeros(())

    def state_dict(self) -> dict:
        return {"n": self.n, "total": self.total.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.total = sd["n"], sd["total"]


def _run(root: Path, cls: type, stop: int = STEPS, resume: bool = False, limit: int | None = None) -> dict:
    """Train a tiny model for ``STEPS`` steps with a save every ``EVERY``, stopping after ``stop`` steps."""
    torch.manual_seed(0)
    acc = cls(cpu=True, project_config=ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True,
                                                            total_limit=limit),
              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    x = torch.randn(48, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4,
                                       shuffle=True)
    model, opt, sched, data = acc.prepare(model, opt, sched, data)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    done = 0
    if resume:
        acc.load_state()
        done = counter.n
        if cls is Accelerator:  # its load_state leaves the counter at 0: the next save_state would collide
            acc.project_configuration.iteration = len(list((root / "checkpoints").iterdir()))
    batches = acc.skip_first_batches(data, done) if done else data
    for xb, yb in batches:
        if done >= stop:
            break
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        done += 1
        counter.n, counter.total = done, counter.total + xb.sum()
        if done % EVERY == 0:
            acc.save_state()
    out = {f"w/{k}": v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    out.update({f"o/{i}/{k}": v.clone() for i, s in enumerate(opt.optimizer.state.values()) for k, v in s.items()})
    # (the global RNG is not compared: a DataLoader draws its base seed from it when an iterator starts, which a
    # resumed run does after load_state and the straight run did at step 0; that is the DataLoader's, not ours)
    out.update(lr=torch.tensor(opt.param_groups[0]["lr"]), total=counter.total)
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
