"""Lightning's loads outside ``fit`` on ckptio checkpoint folders, with the real pytorch_lightning, the user's code as
Lightning documents it: ``LitModel.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)``,
``LightningDataModule.load_from_checkpoint``, ``trainer.test(ckpt_path="best")``, ``validate(ckpt_path=path)``,
``predict(ckpt_path="last")``, and a ``Trainer`` built without the plugin (an evaluation script).

Each gives what the same run with Lightning's own ``.ckpt`` files gives, bitwise: the weights the trainer had at that
checkpoint, its hyper-parameters, the same metrics and predictions; with background saves too. A damaged folder is
refused naming the file; a plain ``.ckpt`` file still goes through Lightning's own loader.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from distributed import launch  # noqa: E402
from lit_tiny import Evaluated, TinyData  # noqa: E402

from ckptio import CheckpointCorruptError, CheckpointError  # noqa: E402
from ckptio.lightning import CkptioCheckpointIO, install_loader, uninstall_loader  # noqa: E402

EPOCHS = 3
HPARAMS = {"width": 8, "lr": 0.03}


class Seen(pl.Callback):
    """The LightningModule's state_dict at every checkpoint Lightning takes, by global step."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict) -> None:
        weights = checkpoint["state_dict"]
        self.states[trainer.global_step] = type(weights)((k, v.detach().clone()) for k, v in weights.items())


def _trainer(root: Path | None = None, plugins: list | None = None, seen: Seen | None = None) -> Any:
    callbacks: list = [seen] if seen is not None else []
    if root is not None:  # mode="max": the best checkpoint is an early one, not the weights fit ends with
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(root), monitor="val_loss", mode="max", save_top_k=2,
                                                      save_last=True))
    return pl.Trainer(max_epochs=EPOCHS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", devices=1, plugins=plugins or [], deterministic=True, callbacks=callbacks,
                      enable_checkpointing=root is not None)


def _run(root: Path, plugins: list | None) -> dict[str, Any]:
    """Fit, then every load outside ``fit`` a user does next; what each gave."""
    torch.manual_seed(0)
    seen, data = Seen(), TinyData(width=HPARAMS["width"])
    tr = _trainer(root, plugins, seen)
    tr.fit(Evaluated(**HPARAMS), datamodule=data)
    best = tr.checkpoint_callback.best_model_path
    other = sorted(set(tr.checkpoint_callback.best_k_models) - {best})[0]
    loaded = Evaluated.load_from_checkpoint(best)
    return {
        "names": sorted(p.name for p in root.iterdir() if not p.name.startswith(".")),
        "best": Path(best).name, "at_best": seen.states[int(re.search(r"step=(\d+)", best).group(1))],
        "weights": loaded.state_dict(), "hparams": dict(loaded.hparams),
        "data_hparams": dict(TinyData.load_from_checkpoint(best).hparams),
        "test": tr.test(ckpt_path="best", datamodule=data, verbose=False),
        "validate": tr.validate(ckpt_path=other, datamodule=data, verbose=False),
        "predict": tr.predict(ckpt_path="last", datamodule=data),
        "fresh_test": _trainer().test(Evaluated(**HPARAMS), datamodule=data, ckpt_path=best, verbose=False),
        "fresh_predict": _trainer().predict(Evaluated(**HPARAMS), datamodule=data, ckpt_path=other),
    }


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("plain"), None)


def _same(a: Any, b: Any, where: str) -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.mark.parametrize("async_save", [False, True])
def test_every_load_outside_fit_gives_what_lightnings_own_files_give(tmp_path, plain, async_save):
    ours = _run(tmp_path, [CkptioCheckpointIO(async_save=async_save)])
    assert (tmp_path / ours["best"] / "manifest.json").is_file()  # each checkpoint is a ckptio folder
    assert ours["names"] == plain["names"] and ours["best"] == plain["best"]
    assert ours["best"] != "last.ckpt" and ours["at_best"]
    _same(ours["weights"], ours["at_best"], "load_from_checkpoint(best) against the weights saved there")
    assert ours["hparams"] == HPARAMS and ours["data_hparams"] == {"n": 32, "batch": 4, "width": HPARAMS["width"]}
    for key in ("weights", "hparams", "data_hparams", "test", "validate", "predict", "fresh_test", "fresh_predict"):
        _same(ours[key], plain[key], f"{key} (async_save={async_save})")


def _fit_one(root: Path) -> str:
    torch.manual_seed(0)
    tr = _trainer(root, [CkptioCheckpointIO()])
    tr.fit(Evaluated(**HPARAMS), datamodule=TinyData(width=HPARAMS["width"]))
    return tr.checkpoint_callback.best_model_path


def test_a_damaged_folder_is_refused_naming_the_file(tmp_path):
    best = Path(_fit_one(tmp_path))
    shard = next((best / "model").glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF  # a weight's bits, the size unchanged
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=re.escape(shard.name)):
        Evaluated.load_from_checkpoint(str(best))
    with pytest.raises(CheckpointCorruptError, match=re.escape(shard.name)):
        TinyData.load_from_checkpoint(best)
    with pytest.raises(CheckpointCorruptError, match=re.escape(shard.name)):
        _trainer().test(Evaluated(**HPARAMS), datamodule=TinyData(width=HPARAMS["width"]), ckpt_path=str(best))
    (best / "manifest.json").unlink()  # a folder that was never committed
    with pytest.raises(CheckpointError, match=re.escape(f"{best.name} is not a committed ckptio checkpoint")):
        Evaluated.load_from_checkpoint(best)


def test_the_loader_is_explicit_and_lightnings_own_files_stay_lightnings(tmp_path):
    from lightning_fabric.utilities.cloud_io import _load as lightnings_load
    from pytorch_lightning.core import saving

    from ckptio.integrations.lightning_load import installed

    best = _fit_one(tmp_path / "ours")
    try:
        uninstall_loader()
        assert saving.pl_load is lightnings_load and not installed()
        with pytest.raises(IsADirectoryError):  # what Lightning alone does with a folder
            Evaluated.load_from_checkpoint(best)
        CkptioCheckpointIO(install_loader=False)
        assert saving.pl_load is lightnings_load
        install_loader()
        install_loader()  # idempotent: wrapped once
        assert saving.pl_load._ckptio_original is lightnings_load and installed()
        assert dict(Evaluated.load_from_checkpoint(best).hparams) == HPARAMS
    finally:
        install_loader()
    torch.manual_seed(0)  # a Lightning .ckpt file: read by Lightning's own loader, not by ckptio
    tr = _trainer(tmp_path / "plain")
    tr.fit(Evaluated(**HPARAMS), datamodule=TinyData(width=HPARAMS["width"]))
    theirs = tr.checkpoint_callback.best_model_path
    assert Path(theirs).is_file()
    _same(Evaluated.load_from_checkpoint(theirs).state_dict(), Evaluated.load_from_checkpoint(best).state_dict(),
          "Lightning's .ckpt against the ckptio folder")


def test_map_location_places_the_tensors_as_torch_load_would(tmp_path):
    from pytorch_lightning.core import saving

    best = _fit_one(tmp_path)
    for where in ("meta", torch.device("meta"), {"cpu": "meta"}, lambda storage, loc: torch.UntypedStorage(
            storage.nbytes(), device="meta")):
        weights = saving.pl_load(best, map_location=where)["state_dict"]
        assert weights and {t.device.type for t in weights.values()} == {"meta"}, where
    for where in (None, "cpu", {"cuda:0": "cpu"}, lambda storage, loc: storage, lambda storage, loc: None):
        weights = saving.pl_load(best, map_location=where)["state_dict"]
        assert {t.device.type for t in weights.values()} == {"cpu"}, where


def test_a_trainer_without_the_plugin_resumes_fit_from_a_folder(tmp_path):
    """An evaluation or follow-up script that forgot the plugin: ``fit(ckpt_path=folder)`` restores everything
    (weights, optimizer moments, scheduler, loops) and ends bitwise equal to the run uninterrupted."""
    from lit_tiny import fit, same

    straight = fit(tmp_path / "straight", 4)
    fit(tmp_path / "ours", 2, [CkptioCheckpointIO()], save_last=True)
    resumed = fit(tmp_path / "theirs", 4, None, ckpt_path=str(tmp_path / "ours" / "last.ckpt"))
    same(resumed, straight, "a folder resumed by a Trainer without the plugin")


_INFERENCE = """
import sys
sys.path.insert(0, sys.argv[2])
from lit_tiny import Evaluated
{setup}
model = Evaluated.load_from_checkpoint(sys.argv[1])
print("LOADED", dict(model.hparams))
"""


def test_an_inference_script_finds_the_one_line_it_needs(tmp_path):
    """Issue 52, row 1: a separate inference script's ``load_from_checkpoint(best_model_path)`` failed with a bare
    ``IsADirectoryError`` that named neither ckptio nor ``install_loader()``. The folder carries a note a user finds
    with ``ls``, ``ckptio inspect`` ends with the line, the docs show it first, and the note's snippet works as
    written, in a process of its own with the real Lightning."""
    from cli_here import ckptio_here

    best = Path(_fit_one(tmp_path))
    note = (best / "HOW-TO-LOAD.txt").read_text()
    assert "from ckptio.lightning import install_loader" in note and "install_loader()" in note
    tests = str(Path(__file__).resolve().parent)
    snippet = "\n".join(line.strip() for line in note.splitlines() if line.startswith("    ") and "import" in line
                        or line.strip() == "install_loader()")
    scripts = {}
    for name, setup in (("plain", ""), ("loaded", snippet)):  # each run in a process of its own (tests/distributed.py)
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(_INFERENCE.format(setup=setup))
    plain = launch(str(scripts["plain"]), str(best), tests, timeout=300)
    assert plain.returncode != 0 and "IsADirectoryError" in plain.stderr  # Lightning alone, as the note says
    loaded = launch(str(scripts["loaded"]), str(best), tests, timeout=300)
    assert loaded.returncode == 0 and f"LOADED {HPARAMS}" in loaded.stdout, loaded.stderr[-3000:]
    shown = ckptio_here("inspect", best)
    assert "from ckptio.lightning import install_loader; install_loader()" in shown.stdout.splitlines()[-1], shown.stdout
    page = (Path(tests).parent / "docs" / "migrate-lightning.md").read_text()
    after_fit = page.split("### After `fit`")[1]
    assert after_fit.index("install_loader()") < after_fit.index("load_from_checkpoint(")
