"""Lightning's Trainer checkpointing through ckptio (``CkptioCheckpointIO``), with the real pytorch_lightning.

What a user adds is ``plugins=[CkptioCheckpointIO()]``; ``ModelCheckpoint``, ``top_k``, ``last`` and
``fit(ckpt_path=...)`` stay Lightning's. Proven here: the checkpoints kept are those Lightning keeps with its own
files for the same run; a run stopped and resumed with ``ckpt_path="last"`` ends bitwise equal to the run
uninterrupted (sync and background saves); Lightning's own ``.ckpt`` resumes under the plugin; a damaged
checkpoint is refused naming the file; each checkpoint is a committed ckptio folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from lit_tiny import Tiny, loader, state, trainer  # noqa: E402

from ckptio import CheckpointCorruptError  # noqa: E402
from ckptio.lightning import CkptioCheckpointIO, read_checkpoint  # noqa: E402

EPOCHS = 4


def _fit(root: Path, epochs: int, plugins=None, ckpt_path=None, **checkpoint) -> dict:
    torch.manual_seed(0)
    module = Tiny()
    checkpoint.setdefault("every_n_epochs", 1)
    checkpoint.setdefault("save_top_k", -1)
    tr = trainer(root, epochs, plugins, **checkpoint)
    tr.fit(module, loader(), ckpt_path=ckpt_path)
    return state(module, tr)


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    return _fit(tmp_path_factory.mktemp("straight"), EPOCHS)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_stopped_fit_resumes_from_last_bitwise(tmp_path, straight, async_save):
    io = CkptioCheckpointIO(async_save=async_save)
    _fit(tmp_path, 2, [io], save_last=True)
    last = tmp_path / "last.ckpt"
    assert last.is_dir() and (last / "manifest.json").is_file() and (last / "model").is_dir()
    resumed = _fit(tmp_path, EPOCHS, [CkptioCheckpointIO(async_save=async_save)], ckpt_path="last", save_last=True)
    _same(resumed, straight, f"ckptio resume (async={async_save})")


def test_the_checkpoints_kept_are_the_ones_lightning_keeps(tmp_path):
    kept = {}
    for name, plugins in (("lightning", None), ("ckptio", [CkptioCheckpointIO()])):
        root = tmp_path / name
        _fit(root, EPOCHS, plugins, monitor="train_loss", mode="min", save_top_k=2, save_last=True,
             every_n_epochs=None, every_n_train_steps=3)
        kept[name] = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert kept["ckptio"] == kept["lightning"] and len(kept["ckptio"]) == 3, kept
    for name in kept["ckptio"]:
        manifest = json.loads((tmp_path / "ckptio" / name / "manifest.json").read_text())
        assert manifest["states"]["model"]["format"] == "safetensors"


def test_lightnings_own_ckpt_resumes_under_the_plugin(tmp_path, straight):
    _fit(tmp_path, 2, save_last=True)  # Lightning's own .ckpt files
    assert (tmp_path / "last.ckpt").is_file()
    resumed = _fit(tmp_path, EPOCHS, [CkptioCheckpointIO()], ckpt_path=str(tmp_path / "last.ckpt"))
    _same(resumed, straight, "Lightning .ckpt -> ckptio")


def test_the_whole_dict_comes_back(tmp_path):
    """Everything Lightning put in the dict (loops, callbacks, schedulers, hyper-parameters, the precision state)
    reads back with the same structure, tensors included."""
    _fit(tmp_path / "a", 1)
    _fit(tmp_path / "b", 1, [CkptioCheckpointIO()])
    name = sorted(p.name for p in (tmp_path / "a").iterdir())[-1]
    theirs = torch.load(tmp_path / "a" / name, weights_only=True)
    ours = read_checkpoint(tmp_path / "b" / name)

    def walk(x, y, where):
        assert type(x) is type(y) or isinstance(x, dict) and isinstance(y, dict), where
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), where
        elif isinstance(x, dict):
            assert list(x) == list(y), where
            for k in x:
                walk(x[k], y[k], f"{where}/{k}")
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), where
            for i, (a, b) in enumerate(zip(x, y)):
                walk(a, b, f"{where}/{i}")
        elif isinstance(x, str):
            assert x.replace(str(tmp_path / "a"), str(tmp_path / "b")) == y, where  # the callbacks' dirpath
        else:
            assert x == y, where

    theirs.pop("pytorch-lightning_version")
    ours.pop("pytorch-lightning_version")
    walk(theirs, ours, name)


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path):
    _fit(tmp_path, 1, [CkptioCheckpointIO()], save_last=True)
    shard = next((tmp_path / "last.ckpt" / "state").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        _fit(tmp_path, 2, [CkptioCheckpointIO()], ckpt_path="last")


# ------------------------------------------------------------------------------------------ DDP and the example
ROOT = Path(__file__).resolve().parents[1]


def _torchrun(*args: str) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "lit_ddp_run.py"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "rank0]" in line or "Error" in line]
    assert done.returncode == 0, "\n".join(errors[-40:]) or done.stderr[-3000:]


@pytest.mark.slow
def test_ddp_on_two_ranks_resumes_bitwise_from_ckptio_and_from_lightnings_files(tmp_path):
    _torchrun(str(tmp_path / "straight"), str(EPOCHS), str(tmp_path / "straight.pt"))
    _torchrun(str(tmp_path / "ours"), "2", str(tmp_path / "first.pt"))
    assert (tmp_path / "ours" / "last.ckpt" / "manifest.json").is_file()  # rank 0 wrote a committed folder
    _torchrun(str(tmp_path / "ours"), str(EPOCHS), str(tmp_path / "resumed.pt"), "--resume")
    # a DDP run checkpointed by Lightning itself, resumed under the plugin
    _torchrun(str(tmp_path / "theirs"), "2", str(tmp_path / "theirs.pt"), "--plain")
    assert (tmp_path / "theirs" / "last.ckpt").is_file()
    _torchrun(str(tmp_path / "theirs"), str(EPOCHS), str(tmp_path / "adopted.pt"), "--resume")
    straight = torch.load(tmp_path / "straight.pt")
    _same(torch.load(tmp_path / "resumed.pt"), straight, "DDP, ckptio -> ckptio")
    _same(torch.load(tmp_path / "adopted.pt"), straight, "DDP, Lightning .ckpt -> ckptio")


def test_the_example_trains_and_resumes(tmp_path):
    import subprocess
    import sys

    script = ROOT / "examples" / "lightning" / "train.py"
    for epochs, step in ((1, 16), (2, 32)):
        done = subprocess.run([sys.executable, str(script), "--dir", str(tmp_path), "--epochs", str(epochs)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and f"trained to step {step}" in done.stdout, done.stderr[-2000:]
    assert (tmp_path / "last.ckpt" / "manifest.json").is_file()


def test_a_ckptio_folder_replaces_a_lightning_file_of_the_same_name(tmp_path):
    """A run that switches to the plugin writes last.ckpt over Lightning's own last.ckpt file: exchanged whole."""
    _fit(tmp_path, 1, save_last=True)
    assert (tmp_path / "last.ckpt").is_file()
    _fit(tmp_path, 2, [CkptioCheckpointIO()], ckpt_path="last", save_last=True)
    assert (tmp_path / "last.ckpt" / "manifest.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftover of the exchange
