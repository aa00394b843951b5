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

pytorch_lightning = pytest.importorskip("pytorch_lightning")

from distributed import launch  # noqa: E402
from lit_tiny import Tiny, fit, loader, same, trainer  # noqa: E402

from ckptio import CheckpointCorruptError  # noqa: E402
from ckptio.lightning import CkptioCheckpointIO, read_checkpoint  # noqa: E402

EPOCHS = 4


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    return fit(tmp_path_factory.mktemp("straight"), EPOCHS)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_stopped_fit_resumes_from_last_bitwise(tmp_path, straight, async_save):
    io = CkptioCheckpointIO(async_save=async_save)
    fit(tmp_path, 2, [io], save_last=True)
    last = tmp_path / "last.ckpt"
    assert last.is_dir() and (last / "manifest.json").is_file() and (last / "model").is_dir()
    resumed = fit(tmp_path, EPOCHS, [CkptioCheckpointIO(async_save=async_save)], ckpt_path="last", save_last=True)
    same(resumed, straight, f"ckptio resume (async={async_save})")


def test_the_checkpoints_kept_are_the_ones_lightning_keeps(tmp_path):
    kept = {}
    for name, plugins in (("lightning", None), ("ckptio", [CkptioCheckpointIO()])):
        root = tmp_path / name
        fit(root, EPOCHS, plugins, monitor="train_loss", mode="min", save_top_k=2, save_last=True,
             every_n_epochs=None, every_n_train_steps=3)
        kept[name] = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert kept["ckptio"] == kept["lightning"] and len(kept["ckptio"]) == 3, kept
    for name in kept["ckptio"]:
        manifest = json.loads((tmp_path / "ckptio" / name / "manifest.json").read_text())
        assert manifest["states"]["model"]["format"] == "safetensors"


def test_lightnings_own_ckpt_resumes_under_the_plugin(tmp_path, straight):
    fit(tmp_path, 2, save_last=True)  # Lightning's own .ckpt files
    assert (tmp_path / "last.ckpt").is_file()
    resumed = fit(tmp_path, EPOCHS, [CkptioCheckpointIO()], ckpt_path=str(tmp_path / "last.ckpt"))
    same(resumed, straight, "Lightning .ckpt -> ckptio")


def test_the_whole_dict_comes_back(tmp_path):
    """Everything Lightning put in the dict (loops, callbacks, schedulers, hyper-parameters, the precision state)
    reads back with the same structure, tensors included."""
    fit(tmp_path / "a", 1)
    fit(tmp_path / "b", 1, [CkptioCheckpointIO()])
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
    fit(tmp_path, 1, [CkptioCheckpointIO()], save_last=True)
    shard = next((tmp_path / "last.ckpt" / "state").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        fit(tmp_path, 2, [CkptioCheckpointIO()], ckpt_path="last")


# ------------------------------------------------------------------ preemption, kills, DDP and the example
ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(ROOT / "tests" / "lit_run.py")


def _run(*args: str, ranks: int = 1, ok: bool = True) -> str:
    """``tests/lit_run.py`` in a process of its own (``ranks=1``) or under torchrun; ``ok=False``: the run must
    end early, preempted (Lightning exits with status 0 on SIGTERM) or killed, before writing its OUT file."""
    done = launch(RUNNER, *args, *(("--ddp",) if ranks > 1 else ()), ranks=ranks)
    text = done.stdout + done.stderr
    if ok:
        errors = [line for line in text.splitlines() if "rank0]" in line or "Error" in line]
        assert done.returncode == 0, "\n".join(errors[-40:]) or text[-3000:]
    else:
        assert not Path(args[2]).exists(), f"{args}: the run was meant to stop early and did not"
    return text


def _preempt_kill_resume(root: Path, ranks: int, *extra: str) -> dict:
    """SIGTERM after step 12 (mid-epoch 1: the last checkpoint is epoch 0's), then a rerun SIGKILLed while its
    second save is written and not yet in place (``last.ckpt`` being replaced), then a rerun to the end."""
    per_epoch = 8 // ranks
    text = _run(str(root), str(EPOCHS), str(root / "x.pt"), "--sigterm-at", str(per_epoch + per_epoch // 2),
                *extra, ranks=ranks, ok=False)
    assert "Received SIGTERM" in text
    assert (root / "last.ckpt" / "manifest.json").is_file()
    assert read_checkpoint(root / "last.ckpt")["global_step"] == per_epoch  # epoch 0's save; epoch 1 was cut
    _run(str(root), str(EPOCHS), str(root / "y.pt"), "--resume", "--kill-at", "commit.before_rename:2", *extra,
         ranks=ranks, ok=False)
    assert read_checkpoint(root / "last.ckpt")["global_step"] == per_epoch  # the old last.ckpt, whole
    assert any(p.name.startswith(".last.ckpt.tmp-") for p in root.iterdir())  # the killed save's folder
    _run(str(root), str(EPOCHS), str(root / "resumed.pt"), "--resume", *extra, ranks=ranks)
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == [".ckptio_record.json"]  # swept by the next save
    return torch.load(root / "resumed.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_preempted_and_killed_mid_save_then_resumed_ends_bitwise_equal(tmp_path, straight, async_save):
    extra = ("--async",) if async_save else ()
    same(_preempt_kill_resume(tmp_path, 1, *extra), straight, f"1 rank, SIGTERM + SIGKILL (async={async_save})")


@pytest.mark.slow
def test_ddp_on_two_ranks_preempted_killed_resumed_and_adopted(tmp_path):
    """2 DDP ranks: SIGTERM, SIGKILL mid-save and resume end bitwise equal to the straight run; Lightning's own
    files of a DDP run resume under the plugin; the 2-rank checkpoint resumes on 1 rank."""
    _run(str(tmp_path / "straight"), str(EPOCHS), str(tmp_path / "straight.pt"), "--plain", ranks=2)
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    same(_preempt_kill_resume(tmp_path / "ours", 2), straight, "DDP, SIGTERM + SIGKILL -> ckptio resume")
    _run(str(tmp_path / "theirs"), "2", str(tmp_path / "theirs.pt"), "--plain", ranks=2)
    assert (tmp_path / "theirs" / "last.ckpt").is_file()
    _run(str(tmp_path / "theirs"), str(EPOCHS), str(tmp_path / "adopted.pt"), "--resume", ranks=2)
    same(torch.load(tmp_path / "adopted.pt", weights_only=True), straight, "DDP, Lightning .ckpt -> ckptio")
    # another number of ranks: the 2-rank run's last.ckpt (step 16 of 4 steps an epoch) goes on on 1 rank
    saved = read_checkpoint(tmp_path / "ours" / "last.ckpt")
    torch.manual_seed(0)
    module, tr = Tiny(), trainer(tmp_path / "ours", EPOCHS + 1, [CkptioCheckpointIO()], every_n_epochs=1,
                                 save_top_k=-1, save_last=True)
    seen = {}
    tr.callbacks.append(_Peek(seen))
    tr.fit(module, loader(), ckpt_path="last")
    same(seen["weights"], {k: v for k, v in saved["state_dict"].items()}, "2 ranks -> 1 rank, restored weights")
    assert saved["global_step"] == 4 * EPOCHS and tr.global_step == 4 * EPOCHS + 8  # one more epoch of 8 steps


class _Peek(pytorch_lightning.Callback):
    def __init__(self, seen: dict) -> None:
        self.seen = seen

    def on_train_start(self, trainer, module) -> None:  # noqa: ANN001
        self.seen["weights"] = {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_leftovers_of_killed_saves_are_swept_and_nothing_else(tmp_path):
    from ckptio.lightning import write_checkpoint
    from ckptio.storage.posix import sweep_leftovers

    kept = {"epoch=0-step=8.ckpt", "last.ckpt", ".hidden-by-the-user", "notes.replaced-0badc0de"}
    write_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 8}, tmp_path / "last.ckpt")
    write_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 8}, tmp_path / "epoch=0-step=8.ckpt")
    gone = {".last.ckpt.tmp-0123abcd", ".trash-last.ckpt-89abcdef", "last.ckpt.replaced-00ff00ff"}
    for name in gone | {".hidden-by-the-user", "notes.replaced-0badc0de"}:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(b"x")
    (tmp_path / ".link.tmp-0123abcd").symlink_to(tmp_path / "last.ckpt")
    kept.add(".link.tmp-0123abcd")
    assert {p.name for p in sweep_leftovers(tmp_path)} == gone
    assert {p.name for p in tmp_path.iterdir()} == kept
    assert read_checkpoint(tmp_path / "last.ckpt")["global_step"] == 8


def test_the_example_trains_and_resumes(tmp_path):
    script = ROOT / "examples" / "lightning" / "train.py"
    for epochs, step in ((1, 16), (2, 32)):
        done = launch(str(script), "--dir", str(tmp_path), "--epochs", str(epochs), timeout=300)
        assert done.returncode == 0 and f"trained to step {step}" in done.stdout, done.stderr[-2000:]
        assert f"best model: {tmp_path}" in done.stdout and "(width 32)" in done.stdout, done.stdout[-2000:]
    assert (tmp_path / "last.ckpt" / "manifest.json").is_file()


def test_a_ckptio_folder_replaces_a_lightning_file_of_the_same_name(tmp_path):
    """A run that switches to the plugin writes last.ckpt over Lightning's own last.ckpt file: exchanged whole."""
    fit(tmp_path, 1, save_last=True)
    assert (tmp_path / "last.ckpt").is_file()
    fit(tmp_path, 2, [CkptioCheckpointIO()], ckpt_path="last", save_last=True)
    assert (tmp_path / "last.ckpt" / "manifest.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [".ckptio_record.json"]  # no leftover of the exchange


def test_a_state_dict_of_sharded_tensors_is_refused_naming_the_type(tmp_path):
    """What FSDP/TP strategies would hand over if they went through a CheckpointIO with sharded states: DTensors on
    a real (1-rank gloo) process group, refused before anything is written."""
    import subprocess
    import sys

    code = f"""
import torch, torch.distributed as dist
from torch.distributed.tensor import distribute_tensor, Shard, init_device_mesh
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
from ckptio.lightning import write_checkpoint
try:
    write_checkpoint({{"state_dict": {{"w": distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])}}}}, "{tmp_path}/x.ckpt")
except TypeError as exc:
    print("REFUSED", exc)
dist.destroy_process_group()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in done.stdout and "DTensor" in done.stdout, done.stderr[-2000:]
    assert not [p.name for p in tmp_path.iterdir() if p.name != "store"]  # nothing written, no hidden leftover


def test_inspect_of_a_plugin_checkpoint_shows_the_monitored_metric(tmp_path):
    """Issue 52, row 10: ``ckptio inspect last.ckpt`` of a run that monitored a metric said ``metrics: none``."""
    from cli_here import ckptio_here

    fit(tmp_path, 2, [CkptioCheckpointIO()], monitor="train_loss", mode="min", save_top_k=1, save_last=True)
    manifest = json.loads((tmp_path / "last.ckpt" / "manifest.json").read_text())
    assert set(manifest["metrics"]) == {"train_loss"}, manifest["metrics"]
    shown = ckptio_here("inspect", tmp_path / "last.ckpt")
    assert shown.returncode == 0 and f"metrics: train_loss={manifest['metrics']['train_loss']:g}" in shown.stdout, \
        shown.stdout + shown.stderr
