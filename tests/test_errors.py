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
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckptio.lock", ".ckptio_record.json", "LATEST",
                                                          "epoch_0_step_3"]
    shutil.rmtree(tmp_path / "epoch_0_step_3")
    assert _manager(tmp_path, _mlp()).restore() is None  # dangling LATEST is not trusted


def test_errors_share_one_root():
    for cls in (CheckpointNotFoundError, CheckpointMismatchError, CheckpointCorruptError, ConfigError):
        assert issubclass(cls, CheckpointError)


# ---------------------------------------------------------------- what a newcomer trips on (issue 52, rows 3-5)
def test_a_monitor_with_no_metrics_at_the_first_save_is_refused_saying_what_to_pass(tmp_path):
    """Row 3: ``save_top_k=1, monitor="val_loss"`` and ``save()`` without metrics kept every checkpoint and never
    wrote BEST, silently. Refused at the first save, as Lightning does; later saves without it are unranked."""
    model = torch.nn.Linear(2, 2)
    cfg = CheckpointConfig(checkpoint_dir=str(tmp_path), save_top_k=1, monitor="val_loss")
    with CheckpointManager(cfg, model=model, rng=False) as mgr:
        with pytest.raises(ConfigError, match=r"monitor='val_loss' is set, but the first save\(\) was passed no "
                                              r"metrics.*save\(metrics=\{'val_loss': value\}\)"):
            mgr.save(step=1)
        assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
        mgr.save(step=2, metrics={"val_loss": 0.5})
        mgr.save(step=3)  # a step without validation: kept unranked
        mgr.save(step=4, metrics={"val_loss": 0.7})
    assert os.readlink(tmp_path / "BEST") == "epoch_0_step_2"


@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_a_checkpoint_dir_that_is_a_file_is_a_config_error_naming_the_setting(tmp_path, where):
    """Row 4: a bare ``FileExistsError: [Errno 17] File exists: 'afile'``."""
    (tmp_path / "afile").write_text("not a folder")
    with pytest.raises(ConfigError, match=rf"checkpoint_dir='.*{where}' (is|is inside .*afile, which is) a file, "
                                          r"not a folder.*checkpoint_dir='checkpoints'"):
        CheckpointConfig(checkpoint_dir=str(tmp_path / where))


@pytest.mark.parametrize("name,ours", [("dirpath", "checkpoint_dir"), ("output_dir", "checkpoint_dir"),
                                       ("save_total_limit", "keep_latest"), ("filename", "name_template")])
def test_another_tools_name_is_answered_with_ckptios(name, ours):
    """Row 5: ``CheckpointConfig(dirpath="x")`` listed 33 field names, some undocumented."""
    with pytest.raises(ConfigError, match=rf"has no field '{name}'; ckptio's name for it: {ours}"):
        CheckpointConfig(**{name: "x"})


def test_an_unknown_field_lists_only_documented_fields():
    from dataclasses import fields
    from pathlib import Path

    with pytest.raises(ConfigError) as err:
        CheckpointConfig(zzzz_qqqq=1)
    listed = str(err.value).split("its fields are ")[1].split("]")[0]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    names = [f.name for f in fields(CheckpointConfig) if f"'{f.name}'" in listed]
    assert names and all(f"`{n}`" in doc.split("## Saving in the background")[0] for n in names), names
    assert "max_recent_checkpoints" not in listed and "is_async" not in listed


# ---------------------------------------------------------------- what a newcomer trips on, round two (issue 71)
_RESTORE_SCRIPT = """
import sys, torch
from ckptio import CheckpointConfig, CheckpointManager
torch.manual_seed(0)
width, restore_from = int(sys.argv[2]), sys.argv[3] or None
model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=sys.argv[1], restore_from=restore_from), model=model)
mgr.save(step=5) if width == 8 else mgr.restore()
"""


def _script(tmp_path, *args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", _RESTORE_SCRIPT, str(tmp_path / "ck"), *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_shape_mismatch_is_one_error_and_a_missing_path_is_named_once(tmp_path):
    """Row 12: a script restoring into a model of another width printed two chained CheckpointMismatchErrors,
    worded differently; a missing absolute ``restore_from`` was named twice ("looked for /x/... and /x/...")."""
    torch.manual_seed(0)  # the script's width-8 save, in this process: only the restores' printed errors need one
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ck")), model=model) as mgr:
        mgr.save(step=5)
    out = _script(tmp_path, "16", "")
    assert out.returncode == 1
    assert out.stderr.count("errors.CheckpointMismatchError:") == 1 and "During handling" not in out.stderr, out.stderr
    assert "0.weight" in out.stderr and "[16, 4]" in out.stderr
    missing = str(tmp_path / "x" / "epoch_0_step_5")
    out = _script(tmp_path, "16", missing)
    assert out.returncode == 1 and out.stderr.count(missing) == 1, out.stderr
    assert "no such checkpoint" in out.stderr.splitlines()[-1]
    # a relative path is looked for where it points, and said so
    out = _script(tmp_path, "16", "x/epoch_0_step_5")
    assert f"no such checkpoint (a relative path: from the working folder {os.getcwd()})" in out.stderr, out.stderr


def restore_through_pointer(checkpoint_dir: str, restore_from: str, cwd) -> str:
    """A user's script restoring with ``restore_from``, run in this process from the folder ``cwd`` (relative paths
    resolve from there, as in the user's process): its last line, or its error as a traceback's last line names it."""
    import contextlib

    with contextlib.chdir(cwd):
        try:
            config = CheckpointConfig(checkpoint_dir=checkpoint_dir, restore_from=restore_from)
            with CheckpointManager(config, model=torch.nn.Linear(4, 4)) as mgr:
                return f"restored step {mgr.restore().step}"
        except CheckpointError as exc:
            return f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"


def test_restore_from_a_folders_latest_or_best_loads_the_step_it_names(tmp_path):
    """Row 9: ``restore_from='ck/LATEST'`` was refused ("not a directory (a link or a file is never a checkpoint)")
    while ``ckptio inspect ck/LATEST`` took it and the README uses it."""
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ck"), monitor="loss"),
                           model=torch.nn.Linear(4, 4)) as mgr:
        mgr.save(step=5, metrics={"loss": 0.5})
        mgr.save(step=10, metrics={"loss": 0.9})
    assert restore_through_pointer("ck", "ck/LATEST", tmp_path) == "restored step 10"
    assert restore_through_pointer("elsewhere", "ck/BEST", tmp_path) == "restored step 5"

    def restore(restore_from: str):
        with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "other"), restore_from=restore_from),
                               model=torch.nn.Linear(4, 4)) as mgr:
            return mgr.restore()

    assert restore(str(tmp_path / "ck" / "LATEST")).step == 10
    # the pointer's target must still be a committed step inside that folder
    (tmp_path / "ck" / "epoch_0_step_10" / "manifest.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="is not usable"):
        restore(str(tmp_path / "ck" / "LATEST"))
    os.remove(tmp_path / "ck" / "BEST")
    os.symlink("../outside", tmp_path / "ck" / "BEST")
    with pytest.raises(CheckpointCorruptError, match="BEST"):
        restore(str(tmp_path / "ck" / "BEST"))


_READ_ONLY_SCRIPT = """
import sys, torch
from ckptio import CheckpointConfig, CheckpointManager, ConfigError, StepScheduler
model = torch.nn.Linear(4, 4)
config = CheckpointConfig(checkpoint_dir=sys.argv[1])
with CheckpointManager(config, model=model) as mgr:  # loads only: a read-only folder is fine
    print("restored step", mgr.restore().step)
try:
    CheckpointManager(config, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                      step_scheduler=StepScheduler(max_steps=10))
except ConfigError as exc:
    print("refused:", exc)
"""


def test_a_read_only_checkpoint_dir_is_refused_when_the_manager_is_made_to_train(tmp_path):
    """Row 10: with a read-only ``checkpoint_dir`` the run said "No checkpoint found … starting from scratch",
    trained, and its first ``save()`` failed on the lock file. A manager made to train (an optimizer, a step
    scheduler) is refused at once, naming the folder; one that only loads from it still loads."""
    import subprocess
    import sys

    from readonly import read_only

    root = tmp_path / "ck"
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root)), model=torch.nn.Linear(4, 4)) as mgr:
        mgr.save(step=3)
    with read_only(root, [sys.executable, "-c", _READ_ONLY_SCRIPT, str(root)]) as argv:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "restored step 3" in out.stdout
    refused = out.stdout.split("refused: ", 1)[-1]
    assert f"checkpoint_dir={str(root)!r}" in refused and "not writable" in refused, out.stdout
