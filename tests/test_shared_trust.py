"""Shared files never widen what a fault destroys (issue 67, rows 1 and 8).

Row 1: a frozen tensor's file, hard-linked by the kept steps, rots by one bit: the running job's next save writes
it anew from the live tensors instead of linking the damaged bytes, the restart resumes from that healthy step, and
no file is held by every kept step. With every step damaged, ``start_fresh_if_damaged=True`` starts fresh.
Row 8: a step whose frozen-tensor file was replaced by other values of the same size under a re-sealed manifest
(a copied-in or hostile step): the live model's next saves store the live bytes, locally and in a bucket.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.engine.manifest import _self_checksum, check_files, read_manifest
from ckptio.errors import CheckpointError
from ckptio.storage import open_storage
from ckptio.storage.checksum import file_checksum
from cli_here import ckptio_here

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _objects(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(128, 16), torch.nn.Linear(16, 128))
    model[0].weight.requires_grad_(False)
    return model, torch.optim.AdamW(model[1].parameters(), lr=1e-3)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randint(0, 128, (2, 4), generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _manager(root: str, model, opt, **config) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(checkpoint_dir=root, **config), model=model, optimizer=opt, rng=False)


def _frozen_file(step_dir: Path) -> Path:
    """The safetensors file that holds the frozen embedding (the one the next steps share)."""
    for path in sorted((step_dir / "model").glob("*.safetensors")):
        header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
        if "0.weight" in header:
            return path
    raise AssertionError(f"no file holds 0.weight in {step_dir}")


def test_a_rotten_shared_file_is_written_anew_and_never_held_by_every_kept_step(tmp_path, caplog):
    root = str(tmp_path / "run")
    model, opt = _objects()
    mgr = _manager(root, model, opt, keep_latest=3)
    for step in range(1, 7):
        _train(model, opt, step)
        mgr.save(step=step)
    steps = {s: Path(root) / f"epoch_0_step_{s}" for s in (4, 5, 6)}
    inodes = {s: _frozen_file(d).stat().st_ino for s, d in steps.items()}
    assert len(set(inodes.values())) >= 2, f"one file holds the frozen tensor of every kept step: {inodes}"
    assert len(set(inodes.values())) < 3, "nothing was shared"
    damaged = _frozen_file(steps[6])  # a copy one step holds: the next save would link it
    assert damaged.stat().st_nlink == 1
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x10
    damaged.write_bytes(bytes(data))  # in place: every link to it sees the flip
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        _train(model, opt, 7)
        saved = Path(mgr.save(step=7))
    mgr.close()
    assert "does not hold the bytes its manifest records" in caplog.text
    assert _frozen_file(saved).stat().st_ino != damaged.stat().st_ino
    folder = open_storage(root).folder(saved.name)
    assert not check_files(folder, read_manifest(folder), checksums=True)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = _objects(seed=1)
    with _manager(root, fresh, fresh_opt, keep_latest=3) as other:
        info = other.restore()
    assert info.step == 7
    for k, v in expected.items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_start_fresh_if_damaged_starts_fresh_when_every_step_is_damaged(tmp_path, caplog):
    root = str(tmp_path / "run")
    model, opt = _objects()
    with _manager(root, model, opt, keep_latest=3) as mgr:
        for step in (1, 2):
            _train(model, opt, step)
            mgr.save(step=step)
    for step in (1, 2):  # every data file of every step rots
        for path in (Path(root) / f"epoch_0_step_{step}").rglob("*"):
            if path.is_file() and path.suffix in (".safetensors", ".distcp"):
                data = bytearray(path.read_bytes())
                data[-2] ^= 0x01
                path.write_bytes(bytes(data))
    fresh, fresh_opt = _objects(seed=1)
    with _manager(root, fresh, fresh_opt, verify="full") as other, pytest.raises(CheckpointError):
        other.restore()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        with _manager(root, fresh, fresh_opt, verify="full", start_fresh_if_damaged=True) as other:
            assert other.restore() is None
    assert "starting from scratch as start_fresh_if_damaged asks" in caplog.text and "no other is left" in caplog.text


def _plant(folder_path: Path, rel: str, manifest_path: Path) -> None:
    """Fill the file's tensor bytes with 0.5 (same size) and re-seal the manifest's checksum of it."""
    path = folder_path / rel
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    n = (len(raw) - start) // 4
    raw[start:] = torch.full((n,), 0.5).numpy().tobytes()
    path.unlink()  # a new file: the links of later steps (none yet) are not touched
    path.write_bytes(bytes(raw))
    data = json.loads(manifest_path.read_text())
    data["checksums"][rel] = file_checksum(path)
    data.pop("manifest_checksum", None)
    data["manifest_checksum"] = _self_checksum(data)
    manifest_path.write_text(json.dumps(data))


def test_a_planted_step_under_a_resealed_manifest_is_never_shared_locally(tmp_path):
    root = str(tmp_path / "run")
    model, opt = _objects()
    with _manager(root, model, opt) as mgr:
        _train(model, opt, 1)
        mgr.save(step=1)
    step1 = Path(root) / "epoch_0_step_1"
    frozen = _frozen_file(step1)
    _plant(step1, frozen.relative_to(step1).as_posix(), step1 / "manifest.json")
    folder = open_storage(root).folder(step1.name)
    assert not check_files(folder, read_manifest(folder), checksums=True)  # the plant passes verify
    with _manager(root, model, opt) as mgr:
        for step in (2, 3):
            _train(model, opt, step)
            mgr.save(step=step)
    live = model[0].weight.detach().clone()
    for step in (2, 3):
        fresh, fresh_opt = _objects(seed=1)
        with _manager(root, fresh, fresh_opt) as other:
            other.restore(f"epoch_0_step_{step}")
        assert torch.equal(fresh[0].weight, live), f"step {step} stores the planted values"


def test_a_planted_object_under_a_resealed_manifest_is_never_referred_to_in_a_bucket(bucket, tmp_path):
    from ckptio.storage import s3 as s3mod

    url = f"s3://{bucket}/planted"
    model, opt = _objects()
    with _manager(url, model, opt) as mgr:
        _train(model, opt, 1)
        mgr.save(step=1)
    s3 = s3mod.client()
    local = tmp_path / "step1"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="planted/epoch_0_step_1/")["Contents"]]
    for key in keys:
        dest = local / key[len("planted/epoch_0_step_1/"):]
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    frozen = _frozen_file(local)
    rel = frozen.relative_to(local).as_posix()
    _plant(local, rel, local / "manifest.json")
    for name in (rel, "manifest.json"):
        s3.put_object(Bucket=bucket, Key=f"planted/epoch_0_step_1/{name}", Body=(local / name).read_bytes())
    with _manager(url, model, opt) as mgr:
        for step in (2, 3):
            _train(model, opt, step)
            mgr.save(step=step)
    live = model[0].weight.detach().clone()
    for step in (2, 3):
        assert rel not in read_manifest(open_storage(url).folder(f"epoch_0_step_{step}")).shared or step == 3
        fresh, fresh_opt = _objects(seed=1)
        with _manager(url, fresh, fresh_opt) as other:
            other.restore(f"epoch_0_step_{step}")
        assert torch.equal(fresh[0].weight, live), f"step {step} stores the planted values"


def _copies_local(root: str) -> dict[int, int]:
    """Committed step -> the inode of the file that holds its frozen embedding (one inode: one copy)."""
    out = {}
    for step_dir in Path(root).glob("epoch_0_step_*"):
        if (step_dir / "manifest.json").is_file():
            out[read_manifest(open_storage(root).folder(step_dir.name)).step] = _frozen_file(step_dir).stat().st_ino
    return out


def _copies_bucket(url: str) -> dict[int, str]:
    """Committed step -> the object that holds its frozen embedding's file (its own, or the one it refers to)."""
    storage = open_storage(url)
    out = {}
    for entry in storage.folder().listdir():
        if entry.kind == "dir" and storage.folder(entry.name).kind("manifest.json") == "file":
            m = read_manifest(storage.folder(entry.name))
            (rel,) = [r for r in m.contents if r.startswith("model/")]  # the one frozen file of this model
            out[m.step] = m.shared.get(rel, f"{m.name}/{rel}")
    return out


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_no_copy_of_a_shared_file_is_held_by_every_kept_step(where, request, tmp_path):
    """From the second save on, whatever retention keeps (3 newest here, or everything), the kept steps hold two
    copies or more of the frozen file: one damaged copy never leaves no step to restore. Sharing still happens."""
    for keep in (3, None):
        if where == "local":
            root, copies = str(tmp_path / f"run{keep}"), _copies_local
        else:
            root, copies = f"s3://{request.getfixturevalue('bucket')}/run{keep}", _copies_bucket
        model, opt = _objects()
        shared = False
        with _manager(root, model, opt, **({"keep_latest": keep} if keep else {})) as mgr:
            for step in range(1, 8):
                _train(model, opt, step)
                mgr.save(step=step)
                held = copies(root)
                assert len(held) < 2 or len(set(held.values())) >= 2, \
                    f"after step {step} (keep {keep}) one copy holds every kept step: {held}"
                shared |= len(set(held.values())) < len(held)
        assert shared, f"nothing was shared (keep {keep})"


def test_a_damaged_copy_in_a_bucket_leaves_a_step_to_restore(bucket):
    """Row 1 in a bucket: the object the newest steps use rots; the restart restores the newest step that uses the
    other copy, bitwise, and the running job's next save holds the live bytes."""
    from ckptio.storage import s3 as s3mod

    url = f"s3://{bucket}/rot"
    model, opt = _objects()
    saved = {}
    mgr = _manager(url, model, opt, keep_latest=3)
    for step in range(1, 6):
        _train(model, opt, step)
        mgr.save(step=step)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    held = _copies_bucket(url)
    verify = ["verify", url, "--json", "--no-progress"]
    out = ckptio_here(*verify)
    assert out.returncode == 0, out.stdout[-3000:]  # healthy: a removed step whose files are used is not damage
    s3 = s3mod.client()
    key = f"rot/{held[5]}"
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-3] ^= 0x10
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    intact = max(s for s, copy in held.items() if copy != held[5])
    out = ckptio_here(*verify)
    assert out.stdout, out.stderr[-2000:]
    report = json.loads(out.stdout)  # ckptio verify on the bucket's folder names every step using the rotten object
    bad = {Path(p).name for p, problems in report["checkpoints"].items() if problems}
    assert out.returncode == 1 and bad == {f"epoch_0_step_{s}" for s, copy in held.items() if copy == held[5]}, out.stdout
    fresh, fresh_opt = _objects(seed=1)
    with _manager(url, fresh, fresh_opt, keep_latest=3) as other:
        info = other.restore()
    assert info is not None and info.step == intact
    for k, v in saved[intact].items():
        assert torch.equal(fresh.state_dict()[k], v), k
    _train(model, opt, 6)
    saved6 = Path(str(mgr.save(step=6))).name
    mgr.close()
    assert _copies_bucket(url)[6] != held[5]
    folder = open_storage(url).folder(saved6)
    assert not check_files(folder, read_manifest(folder), checksums=True)


def test_start_fresh_if_damaged_starts_fresh_with_the_default_verify_and_leaves_the_model_as_it_was(tmp_path, caplog):
    """Row 1's restart: every copy of the frozen file rots; with the default ``verify`` the restore reads weights
    into the live model before it meets the damage. ``start_fresh_if_damaged=True`` starts fresh, as its docs say,
    with the model exactly as it was built (nothing half-read into it) and a warning naming what it gave up."""
    root = str(tmp_path / "run")
    model, opt = _objects()
    with _manager(root, model, opt, keep_latest=3) as mgr:
        for step in range(1, 6):
            _train(model, opt, step)
            mgr.save(step=step)
    for ino in set(_copies_local(root).values()):  # every copy of the frozen file, once
        path = next(p for p in Path(root).rglob("*.safetensors") if p.stat().st_ino == ino)
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    fresh, fresh_opt = _objects(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with _manager(root, fresh, fresh_opt, keep_latest=3) as other, pytest.raises(CheckpointError):
        other.restore()  # without the flag: refused, naming each step
    fresh, fresh_opt = _objects(seed=1)
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        with _manager(root, fresh, fresh_opt, keep_latest=3, start_fresh_if_damaged=True) as other:
            assert other.restore() is None
    assert "starting from scratch as start_fresh_if_damaged asks" in caplog.text
    for k, v in before.items():
        assert torch.equal(fresh.state_dict()[k], v), f"{k} was changed by the failed restores"
    assert not fresh_opt.state, "the optimizer was given a damaged step's state"
