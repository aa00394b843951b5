"""The memory tier behind the one gate: whatever a snapshot holds is read bounded and typed, a snapshot that fails a
check is skipped with its reason (the next older complete one or the durable tier is used), a model that does not
fit a snapshot is refused as the durable tier refuses it, and dropping older snapshots keeps what a restore needs.

One process, a memory folder of the test's own (``CKPTIO_MEMORY_DIR``): the tiny Llama of ``toy.Run`` with a
snapshot every 2 steps and a durable save every 5, so that after step 8 the memory tier holds the snapshot of step 8
and the durable tier the checkpoint of step 5.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from ckptio import CheckpointMismatchError  # noqa: E402
from ckptio.engine.manifest import MANIFEST_NAME, read_manifest  # noqa: E402
from ckptio.storage.checksum import bytes_checksum  # noqa: E402
from ckptio.tier.node import TIER_FILE, NodeFolder  # noqa: E402

CONFIG = dict(max_steps=20, memory_every_steps=2, persist_every_steps=5)


@pytest.fixture
def memory(tmp_path, monkeypatch):
    folder = tmp_path / "shm"
    monkeypatch.setenv("CKPTIO_MEMORY_DIR", str(folder))
    return folder


def _run(tmp_path: Path):
    from toy import Run

    return Run(tmp_path / "ckpt", **CONFIG)


def _snapshots_to(tmp_path: Path, step: int) -> None:
    """Train to ``step`` with snapshots and durable saves, and stop without freeing the memory tier."""
    run = _run(tmp_path)
    run.train(stop_at=step, after_step=run.mgr.maybe_save)
    run.mgr.close(free_memory=False)


def _replace(snapshot: Path, rel: str, data: bytes) -> None:
    """``rel`` of ``snapshot`` holds ``data``, and the manifest says so (size and checksum): only the reader of the
    file itself can tell it is bad."""
    manifest = read_manifest(snapshot)
    path = snapshot / rel
    os.chmod(path, 0o600)
    path.write_bytes(data)
    manifest.files[rel] = len(data)
    manifest.checksums[rel] = bytes_checksum(data)
    os.chmod(snapshot / MANIFEST_NAME, 0o600)
    (snapshot / MANIFEST_NAME).write_text(manifest.to_json())


def _warned(caplog, *parts: str) -> bool:
    return any(all(p in r.getMessage() for p in parts) for r in caplog.records if r.levelno >= logging.WARNING)


# ------------------------------------------------------------------------------------------------- reading
def test_a_deeply_nested_tier_record_skips_the_snapshot_with_its_reason(tmp_path, memory, caplog):
    _snapshots_to(tmp_path, 8)
    snapshot = next(memory.iterdir()) / "epoch_0_step_8"
    _replace(snapshot, TIER_FILE, b"[" * 30_000 + b"]" * 30_000)  # 60 KB, within the file's cap: nesting refused
    caplog.clear()
    info = _run(tmp_path).mgr.restore()
    assert (info.step, info.tier) == (5, "durable")
    assert _warned(caplog, "skipping snapshot", str(snapshot / TIER_FILE), "memory tier record is not valid JSON")


@pytest.mark.parametrize("record", [b'{"run": "x", "durable_step": 1' + b"0" * 400 + b"}",
                                    b'{"run": "x", "durable_step": null, "x": ' + b"[" * 80 + b"]" * 80 + b"}",
                                    b'{"run": 7, "durable_step": null}', b'["run"]', b"\xff\xfe{"])
def test_a_malformed_tier_record_skips_the_snapshot_naming_the_file(tmp_path, memory, caplog, record):
    _snapshots_to(tmp_path, 8)
    snapshot = next(memory.iterdir()) / "epoch_0_step_8"
    _replace(snapshot, TIER_FILE, record)
    caplog.clear()
    info = _run(tmp_path).mgr.restore()
    assert (info.step, info.tier) == (5, "durable")
    assert _warned(caplog, "skipping snapshot", str(snapshot / TIER_FILE))


def _sealed_index(meta: bytes) -> bytes:
    """A chunk index whose seal (size and checksum of its body) is right and whose body is ``meta``."""
    import json

    body = meta + b" " * (-len(meta) % 8)
    head = {"ckptio_chunk_index": 1, "kind": "safetensors", "world_size": 1, "meta_bytes": len(body),
            "body_bytes": len(body), "body_crc32c": bytes_checksum(body)}
    return json.dumps(head).encode() + b"\n" + body


NESTED = b"[" * 30_000 + b"]" * 30_000


@pytest.mark.parametrize("rel, data", [
    ("model/.ckptio-chunks", _sealed_index(NESTED)),
    ("optim/.ckptio-chunks", _sealed_index(b'{"files": [], "tensors": ' + NESTED + b"}")),
    ("optim/values.json", NESTED),
])
def test_a_snapshot_whose_side_file_fails_a_check_leaves_the_restore_to_the_durable_tier(tmp_path, memory, caplog,
                                                                                        rel, data):
    _snapshots_to(tmp_path, 8)
    snapshot = next(memory.iterdir()) / "epoch_0_step_8"
    _replace(snapshot, rel, data)
    caplog.clear()
    info = _run(tmp_path).mgr.restore()
    assert (info.step, info.tier) == (5, "durable")
    assert _warned(caplog, "epoch_0_step_8 could not be restored", rel.split("/")[-1],
                   "falling back to the durable tier")


def test_a_snapshot_damaged_while_restoring_gives_way_to_the_next_older_one(tmp_path, memory, caplog):
    import shutil

    from toy import full_state

    run = _run(tmp_path)
    run.train(stop_at=6, after_step=run.mgr.maybe_save)
    run.mgr.wait()
    at6 = full_state(run.model, run.opt)
    root = next(memory.iterdir())
    shutil.copytree(root / "epoch_0_step_6", tmp_path / "aside", symlinks=True)
    run.train(stop_at=8, after_step=run.mgr.maybe_save)
    run.mgr.close(free_memory=False)
    shutil.copytree(tmp_path / "aside", root / "epoch_0_step_6", symlinks=True)  # two complete snapshots: 6 and 8
    shard = next((root / "epoch_0_step_8" / "optim").glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # found only when its bytes are checked, while restoring
    os.chmod(shard, 0o600)
    shard.write_bytes(bytes(data))
    caplog.clear()
    again = _run(tmp_path)
    info = again.mgr.restore()
    assert (info.step, info.tier) == (6, "memory")
    assert _warned(caplog, "epoch_0_step_8 could not be restored", shard.name,
                   "falling back to snapshot epoch_0_step_6")
    after = full_state(again.model, again.opt)
    assert all(torch.equal(at6[k], after[k]) for k in at6) and at6.keys() == after.keys()


def test_the_candidates_are_every_usable_snapshot_newer_than_the_durable_checkpoint_newest_first():
    from ckptio.tier.choice import candidates
    from ckptio.tier.node import Held

    def held(step: int, files: list[str]) -> Held:
        return Held(step, f"d{step}", 1, files, {"run": "r", "durable_step": 4}, {"total": 2, "manifest_size": 10})

    everyone = [{"s10": held(10, ["a", TIER_FILE]), "s8": held(8, ["a", TIER_FILE]), "s9": held(9, [TIER_FILE]),
                 "s6": held(6, ["a", TIER_FILE])}]
    usable, message = candidates(everyone, "r", 6)
    assert usable == [("s10", "d10"), ("s8", "d8")] and message == "Memory tier: restoring snapshot s10 (step 10)"
    usable, message = candidates([{"s9": everyone[0]["s9"], "s8": everyone[0]["s8"]}], "r", 6)
    assert usable == [("s8", "d8")] and "s9 is incomplete: 1 of its 2 files" in message
    assert candidates(everyone, "r", 10) == ([], "Memory tier: the newest durable checkpoint (step 10) is as new as "
                                                 "the newest usable memory snapshot (s10) or newer")
    assert candidates(everyone, "r", 3)[0] == [], "every snapshot follows a durable checkpoint that is gone"


# ------------------------------------------------------------------------------------------------- shapes
def _with_another_rank_of_tensor(run) -> None:
    """A projection's weight, a 32 x 64 matrix in the checkpoints, becomes a 1 x 32 x 64 tensor in the live model
    (and in its optimizer)."""
    mlp = run.model.model.layers[0].mlp
    old = mlp.down_proj.weight
    new = torch.nn.Parameter(old.detach().clone().unsqueeze(0))
    mlp.down_proj.weight = new
    for group in run.opt.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]


MISMATCH = r"model\.layers\.0\.mlp\.down_proj\.weight: checkpoint \[32, 64\] float32, model \[1, 32, 64\]"


def test_a_model_whose_tensor_has_other_dimensions_is_refused_as_the_durable_tier_refuses_it(tmp_path, memory):
    from toy import Run

    _snapshots_to(tmp_path, 8)
    durable = Run(tmp_path / "ckpt", max_steps=20, persist_every_steps=5)  # no memory tier: the step of 5
    _with_another_rank_of_tensor(durable)
    with pytest.raises(CheckpointMismatchError, match=MISMATCH):
        durable.mgr.restore()

    again = _run(tmp_path)
    _with_another_rank_of_tensor(again)
    with pytest.raises(CheckpointMismatchError, match=MISMATCH) as from_memory:
        again.mgr.restore()
    assert "epoch_0_step_8" in str(from_memory.value) and str(memory) in str(from_memory.value)


# ------------------------------------------------------------------------------------------------- retention
def _snapshot_like(source: Path, root: Path, step: int) -> str:
    """A committed snapshot of ``step`` in ``root``: ``source``'s files under a manifest that says ``step``."""
    import shutil

    name = f"epoch_0_step_{step}"
    shutil.copytree(source, root / name)
    manifest = read_manifest(root / name)
    manifest.step, manifest.name = step, name
    os.chmod(root / name / MANIFEST_NAME, 0o600)
    (root / name / MANIFEST_NAME).write_text(manifest.to_json())
    return name


def test_dropping_older_snapshots_keeps_the_newest_complete_and_the_one_just_written(tmp_path, memory):
    _snapshots_to(tmp_path, 6)
    node = NodeFolder(memory, str(tmp_path / "ckpt"))
    written = node.root / "epoch_0_step_6"
    older = _snapshot_like(written, node.root, 4)
    newer = _snapshot_like(written, node.root, 10)  # complete, and newer than the one just written
    torn = [node.root / "epoch_0_step_12", node.root / ".tmp-epoch_0_step_6-0badc0de", node.root / ".view-0f0f0f0f"]
    for path in torn:
        path.mkdir(mode=0o700)
        (path / "model").mkdir()
    _snapshot_like(written, node.root, 14)
    (node.root / "epoch_0_step_14" / MANIFEST_NAME).write_text('{"step": 14')  # damaged: not a complete snapshot

    removed = node.drop_except({"epoch_0_step_6"})
    assert sorted(p.name for p in node.root.iterdir()) == ["epoch_0_step_10", "epoch_0_step_6", "node-id"]
    assert sorted(removed) == sorted([older, "epoch_0_step_14", *(p.name for p in torn)])
    assert newer not in removed


def test_a_torn_snapshot_is_never_what_is_kept(tmp_path, memory):
    _snapshots_to(tmp_path, 6)
    node = NodeFolder(memory, str(tmp_path / "ckpt"))
    torn = node.root / "epoch_0_step_8"
    torn.mkdir(mode=0o700)  # uncommitted, under the name of the one just written: no manifest
    removed = node.drop_except({"epoch_0_step_8"})
    assert removed == [] and (node.root / "epoch_0_step_6" / MANIFEST_NAME).is_file(), \
        "the newest complete snapshot stays while the one to keep is not committed"
