"""Which step directories without a manifest are adopted as NeMo AutoModel's, and which are damaged ckptio steps.

A folder ckptio wrote carries marks only ckptio writes (its chunk index ``.ckptio-chunks`` in ``model/`` and
``optim/``, ``ckptio_*`` safetensors metadata, ``values.json``...). Without its manifest such a folder is a
damaged ckptio checkpoint: named, skipped for the previous step, never loaded as another tool's folder (whose
contents nothing checks). A folder shaped as AutoModel 0.7 writes it (torch DCP's own files, its losses.json)
is still adopted; what it holds is parsed typed, so a hostile ``losses.json`` makes it a damaged step with its
reason, not a traceback. The real AutoModel round trips are in ``test_automodel.py`` (slow, own environment).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from ckptio import CheckpointConfig, CheckpointManager, CheckpointNotFoundError
from ckptio.adopt.foreign import is_foreign
from ckptio.engine.layout import scan
from cli_here import ckptio_here


def _mlp(fill: float | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if fill is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(fill)
    return model


def _manager(root: Path, model: torch.nn.Module, fmt: str = "torch_save", optimizer: bool = True,
             **cfg) -> CheckpointManager:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
    return CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, **cfg), model=model,
                             optimizer=opt, rng=False)


def _save_two(root: Path, fmt: str, **cfg) -> None:
    model = _mlp()
    with _manager(root, model, fmt, **cfg) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(step))
            mgr.save(step=step)


def _flip_a_model_byte(step: Path) -> None:
    data = max((p for p in (step / "model").iterdir() if not p.name.startswith(".")), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) - 9] ^= 0x40  # in the last stored weight
    data.write_bytes(bytes(raw))


# --------------------------------------------------------------------- a ckptio step that lost its manifest
LOST = {
    # format, optimizer format, what is left besides the data, the mark the report names
    "DCP model, chunk indexes kept": ("torch_save", None, [], "model/.ckptio-chunks"),
    "DCP model, only the optimizer's index left": ("torch_save", None, ["model/.ckptio-chunks"],
                                                   "optim/.ckptio-chunks"),
    "safetensors model, no indexes": ("safetensors", None, ["model/.ckptio-chunks", "optim/.ckptio-chunks"],
                                      "model/shard-"),
    "safetensors optimizer, no indexes and no model": (
        "torch_save", "safetensors", ["model", "optim/.ckptio-chunks"], "optim/"),
}


@pytest.mark.parametrize("case", sorted(LOST))
def test_a_ckptio_step_that_lost_its_manifest_is_damaged_never_adopted(tmp_path, case, caplog):
    fmt, optim_fmt, removed, mark = LOST[case]
    root = tmp_path / "run"
    _save_two(root, fmt, **({"optimizer_save_format": optim_fmt} if optim_fmt else {}))
    step = root / "epoch_0_step_2"
    (step / "manifest.json").unlink()
    for rel in removed:
        target = step / rel
        if target.is_dir():
            import shutil

            shutil.rmtree(target)
        else:
            target.unlink()
    if (step / "model").is_dir():
        _flip_a_model_byte(step)
    entries = {e.name: e for e in scan(root)}
    bad = entries["epoch_0_step_2"]
    assert not bad.committed and not bad.adopted and bad.candidate
    assert "manifest.json is missing" in bad.problem and mark in bad.problem and "ckptio wrote" in bad.problem
    assert entries["epoch_0_step_1"].committed
    assert not is_foreign(str(step))  # nor is it another tool's checkpoint to start from

    model = _mlp()
    with _manager(root, model, fmt) as mgr:
        info = mgr.restore()
    assert info.step == 1 and info.path.name == "epoch_0_step_1"
    assert all(torch.equal(p, torch.full_like(p, 1.0)) for p in model.parameters())
    assert "Skipping" in caplog.text and "epoch_0_step_2" in caplog.text
    with _manager(tmp_path / "elsewhere", _mlp(), fmt, restore_from=str(step)) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="ckptio wrote"):
            mgr.restore()
    listed = ckptio_here("list", root)
    assert listed.returncode == 0 and "NOT USABLE" in listed.stdout and mark in listed.stdout


# --------------------------------------------------------------------------- a folder AutoModel wrote
def _automodel_step(root: Path, name: str, fill: float, losses: str | None) -> None:
    """A step directory as NeMo AutoModel 0.7 writes it with model_save_format=torch_save: torch DCP's own files
    (no ckptio index), a dataloader state per rank, losses.json, config.yaml."""
    step = root / name
    torch_dcp.save(_mlp(fill).state_dict(), storage_writer=torch_dcp.FileSystemWriter(str(step / "model")),
                   no_dist=True)
    (step / "model" / ".hf_metadata").mkdir()
    (step / "model" / ".hf_metadata" / "config.json").write_text("{}")  # AutoModel's, in its hidden folder
    (step / "dataloader").mkdir()
    torch.save({"pos": 3}, step / "dataloader" / "dataloader_dp_rank_0.pt")
    (step / "config.yaml").write_text("step_scheduler:\n  ckpt_every_steps: 4\n")
    if losses is not None:
        (step / "losses.json").write_text(losses)


def test_a_folder_shaped_as_automodel_writes_it_is_still_adopted(tmp_path):
    _automodel_step(tmp_path, "epoch_0_step_4", 4.0, json.dumps({"train_loss": 1.25, "val_loss": None}))
    (entry,) = scan(tmp_path)
    assert entry.committed and entry.adopted and entry.manifest.metrics == {"train_loss": 1.25}
    model = _mlp()
    with _manager(tmp_path, model, optimizer=False) as mgr:
        assert mgr.restore().step == 4
    assert all(torch.equal(p, torch.full_like(p, 4.0)) for p in model.parameters())


@pytest.mark.parametrize("losses", ['{"train_loss": 1' + "0" * 400 + "}", '{"train_loss": -1' + "0" * 400 + "}"])
def test_a_huge_number_in_an_adopted_steps_losses_is_its_reason_and_the_older_step_resumes(tmp_path, losses,
                                                                                            caplog):
    _automodel_step(tmp_path, "epoch_0_step_4", 4.0, json.dumps({"train_loss": 1.5}))
    _automodel_step(tmp_path, "epoch_0_step_8", 8.0, losses)
    entries = {e.name: e for e in scan(tmp_path)}
    bad = entries["epoch_0_step_8"]
    assert not bad.committed and bad.candidate and "losses.json" in bad.problem and "train_loss" in bad.problem
    assert entries["epoch_0_step_4"].committed
    model = _mlp()
    with _manager(tmp_path, model, optimizer=False) as mgr:
        assert mgr.restore().step == 4
    assert all(torch.equal(p, torch.full_like(p, 4.0)) for p in model.parameters())
    assert "Skipping" in caplog.text and "losses.json" in caplog.text
    listed = ckptio_here("list", tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "NOT USABLE" in listed.stdout and "losses.json" in listed.stdout


def test_an_adopted_step_with_a_huge_rank_number_is_its_reason(tmp_path):
    _automodel_step(tmp_path, "epoch_0_step_4", 4.0, None)
    torch.save({"pos": 1}, tmp_path / "epoch_0_step_4" / "dataloader" / f"dataloader_dp_rank_{'9' * 220}.pt")
    (entry,) = scan(tmp_path)
    assert not entry.committed and "rank" in entry.problem and "dataloader_dp_rank_" in entry.problem


# ------------------------------------------------ pickles that pass an opcode walk but would build too much
P4 = b"\x80\x04"
BUILDS_TOO_MUCH = {
    # 64 tuples, each holding the previous one twice, as a dict key: 2^64 hashes (a hang, not an error)
    "hash": P4 + b"}N" + b"2\x86" * 64 + b"Ns.",
    # None inside 1,000,000 tuples as a key: hashing it overflows the C stack (SIGSEGV)
    "depth": P4 + b"}N" + b"\x85" * 1_000_000 + b"Ns.",
    # 2.5 MB of empty sets: ~540 MB of memory from one opcode byte each
    "memory": P4 + b"(" + b"\x8f" * 2_500_000 + b"l.",
}
_RESTORE = """
import logging, sys, torch
logging.basicConfig(level=logging.WARNING)
from ckptio import CheckpointConfig, CheckpointManager
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
class Loader:
    def state_dict(self): return {"pos": 0}
    def load_state_dict(self, state): assert state == {"pos": 3}, state
with CheckpointManager(CheckpointConfig(checkpoint_dir=sys.argv[1], model_save_format="torch_save"), model=model,
                       dataloader=Loader(), rng=False) as mgr:
    print("RESUMED", mgr.restore().step, float(next(model.parameters()).detach().flatten()[0]))
"""


# each kind in each file; the quick loop (-m "not slow") takes each kind once, in one of the two files in turn
@pytest.mark.parametrize("kind, where", [
    pytest.param(kind, where, marks=[pytest.mark.slow] if (i + j) % 2 else [])
    for i, kind in enumerate(sorted(BUILDS_TOO_MUCH))
    for j, where in enumerate(["model/.metadata", "dataloader/dataloader_dp_rank_0.pt"])])
def test_a_pickle_that_would_build_too_much_makes_its_step_damaged_and_the_older_one_resumes(tmp_path, kind, where):
    """Issue 46, rows 1-3: in a fresh process (a hang or a SIGSEGV there would fail this test, not kill the suite),
    in an AutoModel folder (DCP's own files, no ckptio index) and in a ``torch.save`` file read weights-only."""
    _automodel_step(tmp_path, "epoch_0_step_4", 4.0, None)
    _automodel_step(tmp_path, "epoch_0_step_8", 8.0, None)
    target = tmp_path / "epoch_0_step_8" / where
    if where.endswith(".pt"):  # the hostile pickle as the data.pkl of a torch.save archive
        import zipfile

        with zipfile.ZipFile(target, "w") as z:
            z.writestr("archive/data.pkl", BUILDS_TOO_MUCH[kind])
            z.writestr("archive/version", "3\n")
    else:
        target.write_bytes(BUILDS_TOO_MUCH[kind])
    out = subprocess.run([sys.executable, "-c", _RESTORE, str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESUMED 4 4.0" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "refused as a pickle" in out.stderr and str(target) in out.stderr, out.stderr[-3000:]
