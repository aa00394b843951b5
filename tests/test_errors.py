"""Missing, foreign and mismatched checkpoints fail with errors that name the path and the key."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ckptio import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ConfigError,
)


def _manager(root, model, fmt="safetensors", **cfg):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, **cfg),
                             model=model, optimizer=opt, rng=False)


def _mlp(width=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))


def test_fresh_start_when_nothing_saved(tmp_path):
    assert _manager(tmp_path / "none", _mlp()).restore() is None


@pytest.mark.parametrize("restore_from", ["epoch_0_step_99", "LATEST", "/no/such/dir"])
def test_missing_requested_checkpoint(tmp_path, restore_from):
    mgr = _manager(tmp_path, _mlp(), restore_from=restore_from)
    with pytest.raises(CheckpointNotFoundError) as exc:
        mgr.restore()
    assert restore_from in str(exc.value)
    assert isinstance(exc.value, FileNotFoundError)


def test_foreign_directory_is_refused(tmp_path):
    foreign = tmp_path / "someone_elses"
    foreign.mkdir()
    torch.save({"w": torch.ones(2)}, foreign / "pytorch_model.bin")
    with pytest.raises(CheckpointNotFoundError, match="manifest.json is missing") as exc:
        _manager(tmp_path, _mlp(), restore_from=str(foreign)).restore()
    assert str(foreign) in str(exc.value)


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_wrong_shapes_name_path_and_key(tmp_path, fmt):
    _manager(tmp_path, _mlp(8), fmt).save(step=1)
    with pytest.raises(CheckpointMismatchError) as exc:
        _manager(tmp_path, _mlp(16), fmt).restore()
    msg = str(exc.value)
    assert "epoch_0_step_1" in msg and "0.weight" in msg and "[8, 4]" in msg and "[16, 4]" in msg
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_missing_keys_name_the_key(tmp_path, fmt):
    _manager(tmp_path, _mlp(), fmt).save(step=1)
    bigger = torch.nn.Sequential(*_mlp(), torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint.*3\.weight"):
        _manager(tmp_path, bigger, fmt).restore()


def test_truncated_shard_is_reported_and_skipped_by_auto_resume(tmp_path):
    _manager(tmp_path, _mlp()).save(step=1)
    _manager(tmp_path, _mlp()).save(step=2)
    shard = next((tmp_path / "epoch_0_step_2" / "model").glob("*.safetensors"))
    with open(shard, "r+b") as fh:
        fh.truncate(40)
    info = _manager(tmp_path, _mlp()).restore()  # falls back to the previous complete checkpoint
    assert info is not None and info.step == 1
    with pytest.raises(CheckpointNotFoundError, match="damaged"):
        _manager(tmp_path, _mlp(), restore_from="epoch_0_step_2").restore()


def test_corrupt_header_with_matching_size_names_the_file(tmp_path):
    _manager(tmp_path, _mlp()).save(step=1)
    shard = next((tmp_path / "epoch_0_step_1" / "model").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xff\xff\xff"  # garbage in the JSON header, size unchanged
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as exc:
        _manager(tmp_path, _mlp()).restore()
    assert shard.name in str(exc.value)


def reseal(data: dict) -> dict:
    """A hand-edited manifest with a valid self-checksum: what an attacker who knows the format writes."""
    from ckptio.engine.manifest import _self_checksum

    data.pop("manifest_checksum", None)
    data["manifest_checksum"] = _self_checksum(data)
    return data


def test_manifest_listing_paths_outside_is_refused(tmp_path):
    _manager(tmp_path, _mlp()).save(step=1)
    mpath = tmp_path / "epoch_0_step_1" / "manifest.json"
    data = json.loads(mpath.read_text())
    data["states"]["model"]["path"] = "../../etc"
    mpath.write_text(json.dumps(reseal(data)))
    with pytest.raises(CheckpointNotFoundError, match="inside its own step directory"):
        _manager(tmp_path, _mlp(), restore_from="epoch_0_step_1").restore()


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="model_save_format"):
        CheckpointConfig(model_save_format="pickle")
    with pytest.raises(ConfigError, match="save_consolidated"):
        CheckpointConfig(save_consolidated="sometimes")
    with pytest.raises(ConfigError, match=r"\{step\}"):
        CheckpointConfig(name_template="epoch_{epoch}")
    assert CheckpointConfig(save_consolidated="final").save_consolidated == "final"
    assert CheckpointConfig(save_consolidated="true").save_consolidated is True


def test_unserialisable_user_state_fails_at_save_and_leaves_nothing(tmp_path):
    class Bad:
        def state_dict(self):
            return {"fn": os.getcwd}

        def load_state_dict(self, sd):
            pass

    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), extra_states={"bad": Bad()}, rng=False)
    with pytest.raises(TypeError, match="'bad'.*weights_only"):
        mgr.save(step=1)
    assert [p.name for p in tmp_path.iterdir() if p.name != ".ckptio.lock"] == []


def test_save_twice_at_same_step_replaces_atomically(tmp_path):
    m = _mlp()
    mgr = _manager(tmp_path, m)
    mgr.save(step=3)
    with torch.no_grad():
        m[0].weight.fill_(7)
    mgr.save(step=3)
    m2 = _mlp()
    _manager(tmp_path, m2).restore()
    assert torch.all(m2[0].weight == 7)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckptio.lock", "LATEST", "epoch_0_step_3"]
    shutil.rmtree(tmp_path / "epoch_0_step_3")
    assert _manager(tmp_path, _mlp()).restore() is None  # dangling LATEST is not trusted


def test_errors_share_one_root():
    for cls in (CheckpointNotFoundError, CheckpointMismatchError, CheckpointCorruptError, ConfigError):
        assert issubclass(cls, CheckpointError)
