"""Checksums computed while a load reads: deferred hashing of a load's destinations, and which rank
completes which file (each file is read once in all, not once per rank that looked at its header)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.errors import CheckpointCorruptError
from ckptio.storage.checksum import file_checksum
from ckptio.storage.confined import Folder
from ckptio.storage.verify import Verifier, _Hash, finishers
from distributed import run_ranks

MiB = 1 << 20


def _file(tmp_path: Path, size: int) -> tuple[Folder, Verifier, bytes]:
    data = os.urandom(size)
    (tmp_path / "blob.bin").write_bytes(data)
    root = Folder(tmp_path)
    verifier = Verifier(root, {"blob.bin": file_checksum(tmp_path / "blob.bin")})
    return Folder(tmp_path, verifier=verifier), verifier, data


def _read_in_parts(folder: Folder, size: int, parts: int, *, settle: bool) -> torch.Tensor:
    out = torch.empty(size, dtype=torch.uint8)
    bounds = [size * i // parts for i in range(parts + 1)]
    with folder.open("blob.bin") as handle:
        for lo, hi in zip(bounds, bounds[1:]):
            handle.readinto(memoryview(out[lo:hi].numpy()), lo, settle=settle)
    return out


@pytest.mark.parametrize("settle", [True, False])
def test_reads_in_order_hash_the_whole_file_so_finishing_reads_nothing_more(tmp_path, settle):
    size = 13 * MiB + 12345  # pieces of 4 MiB and an odd tail
    folder, verifier, data = _file(tmp_path, size)
    out = _read_in_parts(folder, size, 3, settle=settle)
    assert bytes(out.numpy()) == data
    assert verifier.hashed() == {"blob.bin": size}
    assert verifier.finish(["blob.bin"]) == []


def test_damage_in_the_last_piece_of_a_deferred_read_is_reported(tmp_path):
    size = 9 * MiB
    folder, verifier, data = _file(tmp_path, size)
    damaged = bytearray(data)
    damaged[-10] ^= 0x40  # the last piece: hashed after the read returned
    (tmp_path / "blob.bin").write_bytes(bytes(damaged))
    _read_in_parts(folder, size, 2, settle=False)
    problems = verifier.finish(["blob.bin"])
    assert len(problems) == 1 and "blob.bin" in problems[0] and "corrupted" in problems[0]


def test_deferred_hashing_holds_a_bounded_backlog(tmp_path, monkeypatch):
    monkeypatch.setattr(_Hash, "BACKLOG", 8 * MiB)
    size = 40 * MiB
    folder, verifier, _ = _file(tmp_path, size)
    with folder.open("blob.bin") as handle:
        out = torch.empty(size, dtype=torch.uint8)
        handle.readinto(memoryview(out.numpy()), 0, settle=False)
        assert handle._hash.backlog_bytes <= 8 * MiB
    assert verifier.finish(["blob.bin"]) == []


def test_each_file_is_finished_by_the_rank_that_hashed_most_of_it():
    hashed = [{"a": 100, "b": 10, "shared": 7}, {"a": 100, "b": 50, "c": 3, "shared": 7}, {"d": 0}]
    assert finishers(hashed) == [["a", "shared"], ["b", "c"], ["d"]]
    assert finishers([{}, {}]) == [[], []]


# ---------------------------------------------------------------------------------------- 2 ranks
def _fsdp_restore(root: str, damage: bool) -> str:
    import torch.distributed as dist
    from toy import fsdp_mlp

    def build():
        return fsdp_mlp(512, 3)

    model, opt = build()
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    cfg = CheckpointConfig(checkpoint_dir=root, model_save_format="safetensors")
    CheckpointManager(cfg, model=model, optimizer=opt, rng=False).save(step=1)
    dist.barrier()
    if damage and dist.get_rank() == 1:  # a byte inside the last tensor of rank 1's model shard
        victim = sorted((Path(root) / "epoch_0_step_1" / "model").glob("*.safetensors"))[-1]
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x01
        victim.write_bytes(bytes(data))
    dist.barrier()
    fresh, fresh_opt = build()
    try:
        CheckpointManager(cfg, model=fresh, optimizer=fresh_opt, rng=False).restore(str(Path(root) / "epoch_0_step_1"))
    except CheckpointCorruptError as exc:
        return str(exc)
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters()))
    return "ok" if same else "different"


@pytest.mark.slow
def test_two_ranks_restore_verified_and_catch_damage_in_the_other_ranks_shard(tmp_path):
    assert run_ranks(2, _fsdp_restore, root=str(tmp_path / "clean"), damage=False) == ["ok", "ok"]
    errors = run_ranks(2, _fsdp_restore, root=str(tmp_path / "bad"), damage=True)
    assert all("checksum" in e and ".safetensors" in e for e in errors), errors


def test_closing_a_handle_lets_its_queued_hashes_finish_first(tmp_path):
    """A queued piece may read a small skipped hole through its handle's descriptor: closing the handle
    waits for it (were the descriptor closed first, its number could be reused by the next file opened,
    and that file's bytes hashed instead)."""
    size = 9 * MiB
    folder, verifier, data = _file(tmp_path, size)
    tail = size - 4096
    for _ in range(3):
        v = Verifier(Folder(tmp_path), {"blob.bin": verifier.checksums["blob.bin"]})
        with Folder(tmp_path, verifier=v).open("blob.bin") as handle:
            handle.readinto(bytearray(4096), tail, settle=False)  # ahead: kept aside
            out = torch.empty(tail - 1000, dtype=torch.uint8)  # then the body, short of a 1000-byte hole
            handle.readinto(memoryview(out.numpy()), 0, settle=False)
        assert v.hashed() == {"blob.bin": size}  # the hole was read through the still-open descriptor
        assert v.finish(["blob.bin"]) == []
