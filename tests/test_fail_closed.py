"""Fail closed: hostile or damaged checkpoints never escape their folder, never load wrong data silently,
never crash with a bare exception, and never make ckptio delete what it should keep.

Each test here builds one attack or one kind of damage by hand, the way an attacker or a broken disk
would, and checks the single mechanism that guards against it (the confined folder every reader opens
files through, exact chunk coverage, the self-checksummed manifest, checksums while reading, bounded YAML
and pointers, the lock). Archive link attacks are in ``test_archive.py``, scheduler round trips in
``test_schedulers.py``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch

from ckptio import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
)
from ckptio.formats.dcp import format as dcp_format
from ckptio.formats.safetensors import sharded as safetensors_sharded
from ckptio.engine.layout import resolve_restore_path
from ckptio.engine.manifest import _self_checksum
from ckptio.storage import read_pointer
from cli_here import ckptio_here

CKPTIO = str(Path(sys.executable).parent / "ckptio")
SECRET = b"top secret host file\n"


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


class Box:
    def __init__(self, v: int = 0) -> None:
        self.v = v

    def state_dict(self):
        return {"v": self.v}

    def load_state_dict(self, sd):
        self.v = sd["v"]


def _manager(root: Path, model=None, fmt: str = "safetensors", **cfg) -> CheckpointManager:
    model = model if model is not None else _mlp()
    return CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, **cfg), model=model,
                             optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), rng=False)


def _save_two(root: Path, fmt: str = "safetensors") -> None:
    """Two checkpoints, step 1 (weights 1.0) and step 2 (weights 2.0)."""
    model = _mlp()
    with _manager(root, model, fmt) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(step))
            mgr.save(step=step)


def _reseal(path: Path, edit) -> None:
    """Edit a manifest and give it a valid self-checksum again: what an attacker who knows the format does."""
    data = json.loads(path.read_text())
    edit(data)
    data.pop("manifest_checksum", None)
    data["manifest_checksum"] = _self_checksum(data)
    path.write_text(json.dumps(data))


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real ``ckptio`` executable: for a guard against a hang (its timeout) and for prune while another process
    holds the folder's lock; the other commands run in-process (``ckptio_here``)."""
    return subprocess.run([CKPTIO, *args], capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------- escapes: DCP metadata
def _dcp(folder: Path) -> dict:
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "lr": 0.5}
    dcp_format.save(state, folder)
    return state


def _rewrite_metadata(folder: Path, edit) -> None:
    """Edit ``.metadata`` as a folder written by another DCP tool would carry it: without ckptio's chunk index,
    which a restore would read instead (its own hostile cases are in test_chunk_index.py)."""
    md = pickle.loads((folder / ".metadata").read_bytes())  # our own test file: a plain unpickle is fine here
    edit(md)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    (folder / ".ckptio-chunks").unlink()


def _point_storage_at(md, target: str) -> None:
    for info in md.storage_data.values():
        info.relative_path = target


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_dcp_metadata_naming_a_file_outside_is_refused(tmp_path, where):
    folder = tmp_path / "ck"
    _dcp(folder)
    outside = tmp_path / "outside.distcp"  # a perfectly valid data file, just not inside the folder
    shutil.copyfile(next(folder.glob("*.distcp")), outside)
    target = str(outside) if where == "absolute" else "../outside.distcp"
    _rewrite_metadata(folder, lambda md: _point_storage_at(md, target))
    for fn in (lambda: dcp_format.read_index(folder),
               lambda: dcp_format.load({"w": torch.zeros(3, 4), "lr": 0.0}, folder)):
        with pytest.raises(CheckpointCorruptError, match=r"outside\.distcp"):
            fn()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "device", "truncated"])
def test_dcp_data_file_that_is_not_a_plain_file_of_the_folder_is_refused(tmp_path, kind):
    folder = tmp_path / "ck"
    _dcp(folder)
    data = next(folder.glob("*.distcp"))
    outside = tmp_path / "outside.distcp"
    shutil.copyfile(data, outside)
    data.unlink()
    if kind == "symlink":
        data.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(data)  # opening it for reading would block forever without a writer
    elif kind == "device":
        _rewrite_metadata(folder, lambda md: _point_storage_at(md, "zero"))
        os.symlink("/dev/zero", folder / "zero")
    else:
        data.write_bytes(outside.read_bytes()[:40])
    with pytest.raises(CheckpointCorruptError, match=r"symbolic link|FIFO|not a regular file|truncated|bytes"):
        dcp_format.load({"w": torch.zeros(3, 4), "lr": 0.0}, folder)


def test_verify_reads_nothing_outside_a_step_directory(tmp_path):
    _save_two(tmp_path, "torch_save")
    step = tmp_path / "epoch_0_step_2"
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET)
    victim = next((step / "model").glob("*.distcp"))
    size = victim.stat().st_size
    victim.unlink()
    victim.symlink_to(secret)
    secret.write_bytes(SECRET * (size // len(SECRET)) + SECRET[: size % len(SECRET)])  # same size as before
    out = ckptio_here("verify", step)
    assert out.returncode == 1 and "symbolic link" in out.stdout, out.stdout + out.stderr
    # and the checkpoint is skipped by auto-resume
    model = _mlp()
    info = _manager(tmp_path, model, "torch_save").restore()
    assert info.step == 1 and all(torch.all(p == 1) for p in model.parameters())


# ---------------------------------------------------------------------------------------- escapes: pointers
def test_pointer_leading_outside_through_a_link_is_an_error_and_resume_falls_back(tmp_path):
    root, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    _save_two(root)
    _save_two(elsewhere)  # a complete, valid checkpoint folder that is not this run's
    model = _mlp()
    os.symlink(elsewhere / "epoch_0_step_2", root / "evil")
    (root / "LATEST").unlink()
    os.symlink("evil", root / "LATEST")
    assert resolve_restore_path(root, "LATEST") == root / "epoch_0_step_2"  # falls back to discovery
    (root / "BEST").symlink_to("evil")
    with pytest.raises(CheckpointNotFoundError, match="link"):
        _manager(root, model, restore_from="BEST").restore()
    out = ckptio_here("list", root)
    assert out.returncode == 0 and "warning" in out.stdout and "LATEST -> none" in out.stdout, out.stdout


def test_oversized_pointer_file_is_refused_without_reading_it(tmp_path):
    _save_two(tmp_path)
    (tmp_path / "LATEST").unlink()
    with open(tmp_path / "LATEST.txt", "wb") as fh:
        fh.truncate(8 << 30)  # 8 GiB, sparse: reading it would take the memory
    with pytest.raises(CheckpointCorruptError, match="LATEST.txt.*more than"):
        read_pointer(tmp_path, "LATEST")
    assert resolve_restore_path(tmp_path, "LATEST").name == "epoch_0_step_2"


# ---------------------------------------------------------------------------------------- escapes: the lock
@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_lock_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path, kind):
    root = tmp_path / "ck"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(SECRET)
    (os.symlink if kind == "symlink" else os.link)(victim, root / ".ckptio.lock")
    with pytest.raises(CheckpointError, match=r"\.ckptio\.lock"):
        _manager(root).save(step=1)
    assert victim.read_bytes() == SECRET


def test_a_second_manager_in_the_same_process_shares_the_lock(tmp_path):
    first = _manager(tmp_path)
    first.save(step=1)
    second = _manager(tmp_path)  # a notebook cell run again
    second.save(step=2)
    first.close()
    second.save(step=3)
    second.close()
    holder = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from ckptio.storage.lock import DirectoryLock
        DirectoryLock({str(tmp_path)!r}).acquire(); print("ok")""")], capture_output=True, text=True)
    assert holder.stdout.strip() == "ok", holder.stderr  # released: another process may take it


# ---------------------------------------------------------------------------------------- wrong data: coverage
def _shard(folder: Path, name: str, rows: torch.Tensor, offset: int, total: int) -> None:
    from ckptio.formats.safetensors import _writer as _st_writer

    meta = {"format": "pt", "ckptio_format": safetensors_sharded.FORMAT_TAG,
            "ckptio_shards": json.dumps({"w": {"shape": [total, rows.shape[1]], "offsets": [offset, 0]}})}
    from ckptio.storage import LocalWriteStream

    _st_writer.write(LocalWriteStream(folder / name), [_st_writer.Entry("w", rows.dtype, tuple(rows.shape), lambda: rows)],
                     meta)


def test_safetensors_shards_that_overlap_are_refused_even_when_sizes_add_up(tmp_path):
    # rows 0-2 in one file, row 1 again (stale) in another: 4 rows in all for a 4-row tensor, row 3 never stored
    _shard(tmp_path, "shard-a.safetensors", torch.ones(3, 2), 0, 4)
    _shard(tmp_path, "shard-b.safetensors", torch.full((1, 2), 7.0), 1, 4)
    target = {"w": torch.full((4, 2), -1.0)}
    with pytest.raises(CheckpointCorruptError, match=r"overlap.*shard-a.*shard-b|overlap.*shard-b.*shard-a"):
        safetensors_sharded.load(target, tmp_path)
    assert torch.all(target["w"] == -1)  # refused before anything was read


def test_safetensors_shards_with_a_gap_are_refused(tmp_path):
    _shard(tmp_path, "shard-a.safetensors", torch.ones(1, 2), 0, 4)
    _shard(tmp_path, "shard-b.safetensors", torch.ones(2, 2), 2, 4)
    with pytest.raises(CheckpointCorruptError, match="cover 6 of its 8 elements"):
        safetensors_sharded.read_index(tmp_path)


@pytest.mark.parametrize("damage", ["gap", "duplicate"])
def test_dcp_chunks_that_do_not_cover_a_tensor_exactly_once_are_refused(tmp_path, damage):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _dcp(tmp_path)

    def edit(md):
        entry = md.state_dict_metadata["w"]
        chunk = entry.chunks[0]
        if damage == "gap":
            chunk.sizes = torch.Size([2, 4])  # rows 2.. of the tensor are in no chunk
        else:
            entry.chunks.append(ChunkStorageMetadata(offsets=chunk.offsets, sizes=chunk.sizes))

    _rewrite_metadata(tmp_path, edit)
    target = {"w": torch.full((3, 4), -1.0), "lr": 0.0}
    with pytest.raises(CheckpointCorruptError, match=r"'w'.*(cover 8 of its 12|overlap)"):
        dcp_format.load(target, tmp_path)
    assert torch.all(target["w"] == -1)


# ---------------------------------------------------------------------------------------- wrong data: manifest + bytes
def test_a_bit_flip_in_the_manifest_is_detected(tmp_path):
    _save_two(tmp_path)
    path = tmp_path / "epoch_0_step_2" / "manifest.json"
    text = path.read_text()
    i = text.index('"step": 2')
    flipped = text[: i + 8] + chr(ord(text[i + 8]) ^ 1) + text[i + 9:]  # step 2 -> step 3, still valid JSON
    path.write_text(flipped)
    out = ckptio_here("verify", tmp_path / "epoch_0_step_2")
    assert out.returncode == 1 and "manifest" in out.stdout and "checksum" in out.stdout, out.stdout
    model = _mlp()
    assert _manager(tmp_path, model).restore().step == 1  # auto-resume skips it


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_a_flipped_bit_in_the_data_is_caught_while_loading_by_default(tmp_path, fmt):
    _save_two(tmp_path, fmt)
    victim = next((tmp_path / "epoch_0_step_2" / "model").glob("*.safetensors" if fmt == "safetensors" else "*.distcp"))
    data = bytearray(victim.read_bytes())
    data[data.rindex(struct.pack("<f", 2.0)) + 1] ^= 0x01  # inside a weight of step 2: same size, still parses
    victim.write_bytes(bytes(data))
    model = _mlp()
    info = _manager(tmp_path, model, fmt).restore()  # the default config verifies every byte it reads
    assert info.step == 1 and all(torch.all(p == 1) for p in model.parameters())
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        _manager(tmp_path, _mlp(), fmt, restore_from="epoch_0_step_2").restore()
    # the cheaper modes, chosen per load, do not hash
    _manager(tmp_path, _mlp(), fmt, restore_from="epoch_0_step_2").restore(verify="size")


# ---------------------------------------------------------------------------------------- crashes -> errors
MALFORMED = {
    "wrong type of step": lambda d: d.update(step="2"),
    "state entry not an object": lambda d: d["states"].update(model="model"),
    "state path not a string": lambda d: d["states"]["model"].update(path=5),
    "shape of strings": lambda d: d["model_signature"]["shapes"].update({"0.weight": ["x", 4]}),
    "missing files": lambda d: d.pop("files"),
    "metric not a number": lambda d: d["metrics"].update(loss={"a": 1}),
    "negative size": lambda d: d["files"].update({next(iter(d["files"])): -1}),
    "bad digest": lambda d: d["checksums"].update({next(iter(d["checksums"])): "md5:0"}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_gives_clear_errors_everywhere(tmp_path, case):
    _save_two(tmp_path)
    step = tmp_path / "epoch_0_step_2"
    _reseal(step / "manifest.json", MALFORMED[case])
    for args in (("list", str(tmp_path)), ("verify", str(tmp_path)), ("inspect", str(step)),
                 ("prune", str(tmp_path), "--keep-latest", "1", "--dry-run")):
        out = ckptio_here(*args)
        assert "Traceback" not in out.stderr, (args, out.stderr)
        if args[0] in ("verify", "inspect"):
            assert "manifest" in out.stdout + out.stderr, (args, out.stdout, out.stderr)
    model = _mlp()
    assert _manager(tmp_path, model).restore().step == 1
    with pytest.raises(CheckpointNotFoundError, match="manifest"):
        _manager(tmp_path, _mlp(), restore_from="epoch_0_step_2").restore()


def test_a_state_file_with_the_wrong_structure_is_skipped_by_auto_resume(tmp_path):
    from ckptio.formats import pt as pt_format

    model = _mlp()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=model, rng=True,
                           extra_states={"box": Box(1)}) as mgr:
        mgr.save(step=1)
        mgr.save(step=2)
    rng = tmp_path / "epoch_0_step_2" / "rng" / "rng_global_rank_0.pt"
    data = pt_format.to_bytes({"something": torch.zeros(1)}, "rng")  # valid file, wrong structure
    rng.write_bytes(data)
    _reseal(tmp_path / "epoch_0_step_2" / "manifest.json", lambda d: (
        d["files"].update({"rng/rng_global_rank_0.pt": len(data)}), d["checksums"].pop("rng/rng_global_rank_0.pt")))
    box = Box(0)
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), verify="size"), model=_mlp(),
                            extra_states={"box": box})
    assert mgr.restore().step == 1 and box.v == 1
    with pytest.raises(CheckpointCorruptError, match=r"rng_global_rank_0\.pt.*RNGState"):
        CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), restore_from="epoch_0_step_2", verify="size"),
                          model=_mlp()).restore()


def _nemo_with_config(tmp_path: Path, config_text: str) -> Path:
    folder = tmp_path / "unpacked"
    folder.mkdir()
    (folder / "model_config.yaml").write_text(config_text)
    torch.save({"0.weight": torch.zeros(8, 4)}, folder / "model_weights.ckpt")
    arc = tmp_path / "m.nemo"
    with tarfile.open(arc, "w") as tar:
        for p in sorted(folder.iterdir()):
            tar.add(p, arcname=f"./{p.name}")
    return arc


def test_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1},"
              f" *a{i - 1}]" for i in range(1, 12)]
    arc = _nemo_with_config(tmp_path, "\n".join(lines) + "\nweights: model_weights.ckpt\n")
    out = _cli("inspect", str(arc), timeout=60)  # 9**12 elements if expanded: a hang without the guard
    assert out.returncode == 2 and "aliases are not allowed" in out.stderr, out.stderr


def test_nemo_artifact_that_is_not_inside_the_archive_is_refused(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_bytes(SECRET)
    arc = _nemo_with_config(tmp_path, textwrap.dedent(f"""
        weights: model_weights.ckpt
        hf_config: {{model_type: llama}}
        tokenizer:
          library: huggingface
          files: {{tokenizer.json: "nemo:../../../../../../../../{secret}"}}
        """))
    out = ckptio_here("convert", arc, tmp_path / "out", "--to", "hf", "--no-progress")
    assert out.returncode == 2 and "tokenizer.files.tokenizer.json" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "b").mkdir()
    arc2 = _nemo_with_config(tmp_path / "b", textwrap.dedent(f"""
        weights: model_weights.ckpt
        tokenizer: {{library: sentencepiece, model: {secret}}}
        """))
    out = ckptio_here("inspect", arc2)
    assert out.returncode == 2 and "tokenizer.model" in out.stderr and str(secret) in out.stderr, out.stderr


# ---------------------------------------------------------------------------------------- deleting what to keep
def test_misspelt_monitor_is_refused_at_the_first_save_and_nothing_is_deleted(tmp_path):
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), save_top_k=1, monitor="val_los"),
                            extra_states={"box": Box()}, rng=False)
    with pytest.raises(ConfigError, match=r"val_los.*\['val_loss'\].*did you mean 'val_loss'"):
        mgr.save(step=1, metrics={"val_loss": 0.5})
    assert not any(tmp_path.glob("epoch_*"))
    # nor can the first save pass no metrics at all (issue 52: top-k would then keep everything, silently)
    with pytest.raises(ConfigError, match=r"first save\(\) was passed no metrics"):
        mgr.save(step=1)
    assert not any(tmp_path.glob("epoch_*"))
    mgr.save(step=1, metrics={"val_los": 0.5})
    # after it, a save without metrics (a step without validation) is allowed, and never deleted for lack of one
    for step in (2, 3):
        mgr.save(step=step)
    assert sorted(p.name for p in tmp_path.glob("epoch_*")) == [f"epoch_0_step_{s}" for s in (1, 2, 3)]


def test_prune_refuses_while_a_job_holds_the_folder(tmp_path):
    _save_two(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from ckptio.storage.lock import DirectoryLock
        lock = DirectoryLock({str(tmp_path)!r}); lock.acquire(); print("held", flush=True); time.sleep(60)""")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for force in ([], ["--force"]):  # a live holder is never overridden
            out = _cli("prune", str(tmp_path), "--keep-latest", "1", *force)
            assert out.returncode == 2 and f"pid {holder.pid}" in out.stderr, out.stderr
        assert (tmp_path / "epoch_0_step_1").is_dir()
    finally:
        holder.kill()
        holder.wait()
    out = ckptio_here("prune", tmp_path, "--keep-latest", "1")
    assert out.returncode == 0 and not (tmp_path / "epoch_0_step_1").exists(), out.stderr
    out = ckptio_here("prune", tmp_path, "--save-top-k", "1", "--monitor", "val_los")
    assert out.returncode == 2 and "val_los" in out.stderr


def test_consolidate_into_a_checkpoint_updates_its_manifest_atomically(tmp_path):
    from toy import make_model

    model = make_model(seed=0)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=model, rng=False) as mgr:
        mgr.save(step=1)
    step = tmp_path / "epoch_0_step_1"
    before = {p.relative_to(step).as_posix(): p.read_bytes() for p in step.rglob("*") if p.is_file()}
    out = ckptio_here("consolidate", step, "--no-progress")
    assert out.returncode == 0, out.stderr
    assert ckptio_here("verify", step).returncode == 0
    manifest = json.loads((step / "manifest.json").read_text())
    bundle = [f for f in manifest["files"] if f.startswith("model/consolidated/")]
    assert "model/consolidated/model.safetensors.index.json" in bundle and all(f in manifest["checksums"] for f in bundle)
    for rel, data in before.items():  # every earlier file is unchanged
        if rel != "manifest.json":
            assert (step / rel).read_bytes() == data, rel
    # a failure half-way (the file-size limit stops the bundle's first weight file) changes nothing
    manifest_before = (step / "manifest.json").read_bytes()

    def limit() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    out = subprocess.run([CKPTIO, "consolidate", str(step), "--overwrite", "--no-progress"], capture_output=True,
                         text=True, preexec_fn=limit)
    assert out.returncode == 2 and "File too large" in out.stderr, out.stderr
    assert (step / "manifest.json").read_bytes() == manifest_before
    assert ckptio_here("verify", step).returncode == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# ---------------------------------------------------------------------------------------- damaged is not absent
def _edit_step(path: Path) -> None:
    """An edited manifest (step 2 -> 3, its self-checksum now wrong): what a careless hand or a bad copy leaves."""
    text = path.read_text()
    path.write_text(text.replace('"step": 2', '"step": 3', 1))


def test_when_every_step_directory_is_damaged_auto_resume_refuses_to_start_over(tmp_path, caplog):
    from ckptio import NoUsableCheckpointError

    _save_two(tmp_path)
    _edit_step(tmp_path / "epoch_0_step_2" / "manifest.json")
    (tmp_path / "epoch_0_step_1" / "manifest.json").unlink()
    (tmp_path / "tensorboard").mkdir()  # not a step directory: never reported, never a reason to refuse
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    model = _mlp(seed=7)
    weights = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        with pytest.raises(NoUsableCheckpointError, match="holds 2 step directories and none is usable") as err:
            _manager(tmp_path, model).restore()
    assert [name for name, _ in err.value.skipped] == ["epoch_0_step_1", "epoch_0_step_2"]
    assert "start_fresh_if_damaged" in str(err.value) and "No checkpoint found" not in caplog.text
    for name, why in (("epoch_0_step_1", "manifest.json is missing"), ("epoch_0_step_2", "checksum")):
        assert any(name in r.getMessage() and why in r.getMessage() for r in caplog.records), (name, caplog.text)
    assert "tensorboard" not in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # nothing was loaded
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing was changed
    # LATEST pointing at a damaged step falls back to discovery, which refuses the same way
    with pytest.raises(NoUsableCheckpointError):
        _manager(tmp_path, _mlp(), restore_from="LATEST").restore()

    # the user's choice: start from scratch anyway, said in the log
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        assert _manager(tmp_path, model, start_fresh_if_damaged=True).restore() is None
    assert "starting from scratch as start_fresh_if_damaged asks" in caplog.text
    assert "Skipping" in caplog.text and "epoch_0_step_2" in caplog.text


def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_loads(tmp_path, caplog):
    _save_two(tmp_path)
    _edit_step(tmp_path / "epoch_0_step_2" / "manifest.json")
    model = _mlp()
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        assert _manager(tmp_path, model).restore().step == 1
    assert any("Skipping" in r.getMessage() and "epoch_0_step_2" in r.getMessage() for r in caplog.records), caplog.text


def test_an_empty_folder_or_one_with_unrelated_folders_starts_fresh(tmp_path, caplog):
    (tmp_path / "logs").mkdir()
    (tmp_path / ".tmp-epoch_0_step_3-abc").mkdir()  # an interrupted save: swept, not damage
    with caplog.at_level(logging.INFO, logger="ckptio"):
        assert _manager(tmp_path, _mlp()).restore() is None
    assert "No checkpoint found" in caplog.text and "Skipping" not in caplog.text


def test_opening_sub_folders_holds_no_descriptor(tmp_path):
    """Folder.sub checks the path through real folders and keeps nothing open: a long-lived process (a trainer
    resuming many times, a scan of a large run folder) must not run out of descriptors."""
    import os

    from ckptio.storage.confined import Folder

    (tmp_path / "a" / "b").mkdir(parents=True)
    root = Folder(tmp_path)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(200):
        root.sub("a").sub("b")
    assert len(os.listdir("/proc/self/fd")) <= before


# ---------------------------------------------------------------------------------------- a failed restore changes nothing
def _pruned_run(root: Path) -> dict:
    """Steps 2-4 kept (``keep_latest=3``), only step 4 with its optimizer state; lr 0.01 decayed by 0.9 a step."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    box = Box()
    saved: dict = {}
    cfg = CheckpointConfig(checkpoint_dir=str(root), keep_latest=3, keep_optimizer_latest=1)
    with CheckpointManager(cfg, model=model, optimizer=opt, lr_scheduler=sched, extra_states={"box": box},
                           rng=False) as mgr:
        for step in range(1, 5):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            box.v = step
            mgr.save(step=step)
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    saved["exp_avg"] = opt.state[next(iter(model.parameters()))]["exp_avg"].clone()
    return saved


def _flip_inside(folder: Path, value: torch.Tensor) -> None:
    """Flip a bit of the exponent of the first float of ``value`` where it is stored under ``folder``: the file keeps
    its size and parses; only its checksum tells."""
    raw = value.detach().contiguous().numpy().tobytes()
    for victim in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = bytearray(victim.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at + 3] ^= 0x40
            victim.write_bytes(bytes(data))
            return
    raise AssertionError(f"no file of {folder} holds the value")


def _live(model, opt, sched, box) -> dict:
    import copy

    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": copy.deepcopy(opt.state_dict()),
            "sched": sched.state_dict(), "box": box.v}


def _same_optim(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(s.keys() == b["state"][p].keys() and all(torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][p][k]))
                                                       for k, v in s.items()) for p, s in a["state"].items())


@pytest.mark.parametrize("where", ["optim", "model", "lr_scheduler"])
def test_a_restore_that_fails_changes_nothing_or_says_what_it_changed(tmp_path, where):
    """Issue 67, row 2: the newest step is damaged and the one before has no optimizer state. The failed restore
    leaves the optimizer, the scheduler and the user's state as they were (the model too when the damage is
    not in the model's own files; else the error says that the model was changed), and following its advice in
    the same process gives a run made of one step only."""
    import ast

    saved = _pruned_run(tmp_path)
    newest = tmp_path / "epoch_0_step_4"
    if where == "lr_scheduler":
        victim = newest / "lr_scheduler.pt"
        data = bytearray(victim.read_bytes())
        data[data.index(b"last_epoch") - 40] ^= 0x01  # inside the pickle's bytes: a checksum mismatch only
        victim.write_bytes(bytes(data))
    else:  # a weight of the model, or a moment of the optimizer
        _flip_inside(newest / where, saved["exp_avg"] if where == "optim" else saved[4]["0.weight"])
    model = _mlp(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    box = Box(-1)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()  # this process's own optimizer state, with moments
    sched.step()
    before = _live(model, opt, sched, box)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=model, optimizer=opt,
                           lr_scheduler=sched, extra_states={"box": box}, rng=False) as mgr:
        with pytest.raises(CheckpointError, match="its 'optim' state was removed") as err:
            mgr.restore()
        after = _live(model, opt, sched, box)
        assert _same_optim(after["optim"], before["optim"]), "the optimizer was changed by a failed restore"
        assert after["sched"] == before["sched"] and after["box"] == -1
        model_same = all(torch.equal(after["model"][k], v) for k, v in before["model"].items())
        if where == "model":  # loaded in place (a copy would double it) before its checksum could fail: said so
            assert "the model was changed" in str(err.value) and "epoch_0_step_4" in str(err.value), str(err.value)
            assert "optimizer" not in str(err.value).split("the model was changed")[1].split(";")[0]
        else:
            assert model_same, "the model was changed by a failed restore"
            assert "was changed" not in str(err.value)
        # the advice, followed in the same process: every live object from step 3, none from step 4
        states = ast.literal_eval(re.search(r"states=(\[[^\]]*\])", str(err.value)).group(1))
        info = mgr.restore(tmp_path / "epoch_0_step_3", states=states)
        assert info.step == 3 and box.v == 3 and sched.last_epoch == 3
        assert all(torch.equal(v, saved[3][k]) for k, v in model.state_dict().items())
        assert not opt.state, "the optimizer holds moments of another step"
        assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.9 ** 3)


def _two_ranks_pruned_and_damaged(root: str, where: str) -> dict:
    """On 2 FSDP2 ranks: steps 2-4 kept, step 4 alone with its optimizer; rank 1's own bytes of step 4 (a moment
    of its optimizer shard, or a weight of its model shard) damaged. What the failed restore left, and what
    following its advice gives."""
    import ast
    import copy

    import torch.distributed as dist
    from toy import Counter, make_model

    def full_state(model, opt):  # this rank's own shards
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        out = {f"model/{k}": local(p.detach()).clone() for k, p in model.named_parameters()}
        out.update({f"optim/{k}/{i}/{n}": local(v).clone() for i, (k, p) in enumerate(model.named_parameters())
                    for n, v in opt.state.get(p, {}).items()})
        return out

    os.environ["CKPTIO_TOY_MODEL"] = "plain"
    ids = torch.arange(32).reshape(2, 16) % 64

    def objects(seed: int, lr: float):
        model = make_model(seed=seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9), Counter()

    model, opt, sched, counter = objects(0, 0.01)
    cfg = CheckpointConfig(checkpoint_dir=root, keep_latest=3, keep_optimizer_latest=1)
    with CheckpointManager(cfg, model=model, optimizer=opt, lr_scheduler=sched, extra_states={"c": counter}) as mgr:
        for step in range(1, 5):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            counter.seen = step
            mgr.save(step=step)
    first = next(iter(model.parameters()))
    if dist.get_rank() == 1:
        value = opt.state[first]["exp_avg"] if where == "optim" else first
        _flip_inside(Path(root) / "epoch_0_step_4" / where, value.detach().to_local())
    dist.barrier()
    model, opt, sched, counter = objects(1, 0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    counter.seen = -1
    before = full_state(model, opt)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    out: dict = {}
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt, lr_scheduler=sched,
                           extra_states={"c": counter}) as mgr:
        try:
            mgr.restore()
        except CheckpointError as exc:
            out["error"] = str(exc)
        after = full_state(model, opt)
        out["model kept"] = all(torch.equal(after[k], v) for k, v in before.items() if k.startswith("model/"))
        out["optim kept"] = (after.keys() == before.keys()
                             and all(torch.equal(after[k], v) for k, v in before.items() if k.startswith("optim/"))
                             and groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
        out["small kept"] = counter.seen == -1 and sched.last_epoch == 1
        states = ast.literal_eval(re.search(r"states=(\[[^\]]*\])", out.get("error", "states=[]")).group(1))
        info = mgr.restore(Path(root) / "epoch_0_step_3", states=states)
        out["advice"] = (info.step, counter.seen, sched.last_epoch, not opt.state, opt.param_groups[0]["lr"])
    return out


@pytest.mark.slow  # real ranks
@pytest.mark.parametrize("where", ["optim", "model"])
def test_on_two_ranks_a_failed_restore_changes_nothing_or_says_what_it_changed(tmp_path, where):
    from distributed import run_ranks

    for out in run_ranks(2, _two_ranks_pruned_and_damaged, root=str(tmp_path / "ckpt"), where=where):
        assert "its 'optim' state was removed" in out["error"], out
        assert out["optim kept"] and out["small kept"], out
        assert out["model kept"] == (where != "model"), out
        assert ("the model was changed" in out["error"]) == (where == "model"), out["error"]
        step, seen, epoch, empty, lr = out["advice"]
        assert (step, seen, epoch, empty) == (3, 3, 3, True) and lr == pytest.approx(0.01 * 0.9 ** 3), out
