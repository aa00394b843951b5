"""``ckptio inspect`` and ``ckptio list`` run as a user runs them: the installed console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager

CKPTIO = [str(Path(sys.executable).parent / "ckptio")]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(CKPTIO + list(args), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "checkpoints"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    model[1].float()
    opt = torch.optim.AdamW(model.parameters())
    # the optimizer as DCP (the model as safetensors shards): inspect meets both kinds of folder
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), optimizer_save_format="torch_save"),
                            model=model, optimizer=opt)
    mgr.save(step=10, metrics={"val_loss": 1.5})
    mgr.save(step=20, epoch=1, metrics={"val_loss": 1.25})
    (root / ".tmp-epoch_1_step_30-deadbeef").mkdir()  # an interrupted save
    return root


def test_list_human_and_json(ckpts):
    out = cli("list", str(ckpts))
    assert out.returncode == 0, out.stderr
    assert "epoch_1_step_20 <- LATEST" in out.stdout and "epoch_0_step_10" in out.stdout
    assert "NOT USABLE" in out.stdout and "2 committed" in out.stdout
    data = json.loads(cli("list", str(ckpts), "--json").stdout)
    rows = {r["name"]: r for r in data["checkpoints"]}
    assert data["latest"] == "epoch_1_step_20"
    assert rows["epoch_1_step_20"]["step"] == 20 and rows["epoch_1_step_20"]["committed"]
    assert rows["epoch_1_step_20"]["metrics"] == {"val_loss": 1.25}
    assert not rows[".tmp-epoch_1_step_30-deadbeef"]["committed"]


def test_inspect_step_dir(ckpts):
    out = cli("inspect", str(ckpts / "epoch_1_step_20"))
    assert out.returncode == 0, out.stderr
    for text in ("step 20, epoch 1", "val_loss=1.25", "1 rank(s)", "bfloat16", "float32", "optim"):
        assert text in out.stdout
    data = json.loads(cli("inspect", str(ckpts / "epoch_1_step_20"), "--json").stdout)
    model = data["states"]["model"]["tensors"]
    assert model["tensors"] == 4
    assert model["dtypes"]["bfloat16"] == {"tensors": 2, "bytes": (8 * 16 + 16) * 2}
    assert model["dtypes"]["float32"] == {"tensors": 2, "bytes": (16 * 4 + 4) * 4}
    assert data["world_size"] == 1 and data["model_save_format"] == "safetensors"
    assert sum(data["files"].values()) == data["total_bytes"] > 0


def test_inspect_dcp_folder_and_single_file(ckpts):
    out = cli("inspect", str(ckpts / "epoch_1_step_20" / "optim"), "--json")
    assert json.loads(out.stdout)["kind"] == "dcp"
    files = sorted((ckpts / "epoch_1_step_20" / "model").glob("shard-00001-*.safetensors"))  # one rank's files
    datas = [json.loads(cli("inspect", str(f), "--json").stdout) for f in files]
    assert all(d["kind"] == "safetensors_file" for d in datas)
    assert sum(d["tensors"]["tensors"] for d in datas) == 4


def test_bad_input_gives_a_clear_error_not_a_traceback(ckpts, tmp_path):
    out = cli("inspect", str(tmp_path / "nope"))
    assert out.returncode == 2 and "nope" in out.stderr and "Traceback" not in out.stderr
    out = cli("inspect", str(ckpts))
    assert out.returncode == 2 and "ckptio list" in out.stderr
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}     ")
    out = cli("inspect", str(bad))
    assert out.returncode == 2 and "bad.safetensors" in out.stderr and "Traceback" not in out.stderr
    out = cli("list", str(tmp_path / "nope"))
    assert out.returncode == 2 and "nope" in out.stderr
