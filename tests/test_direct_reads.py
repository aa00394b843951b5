"""Cold files read around the page cache (``storage/reading.py``, ``CKPTIO_DIRECT_READS=1``): the bytes a reader
gets are the file's, whatever the order and size of its reads; a restore of a checkpoint the page cache does not
hold takes that path and is exact; a warm one, or one without the setting, does not; a file cut or damaged while
it is read ends in the error that names it."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.errors import CheckpointCorruptError
from ckptio.storage import reading
from ckptio.storage.confined import Folder
from toy import full_state, make_model

MiB = 1 << 20


@pytest.fixture
def direct_io(tmp_path: Path) -> None:
    """Skip where the file system under the tests cannot read with ``O_DIRECT`` at all (tmpfs on old kernels)."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"\0" * reading.ALIGN)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        pytest.skip(f"{tmp_path} does not take O_DIRECT ({exc})")
    finally:
        probe.unlink()


def _evict(root: Path) -> None:
    """Drop ``root``'s files from the page cache (clean pages only: the files are synced first)."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def test_every_pattern_of_reads_returns_the_files_bytes(tmp_path, monkeypatch, direct_io):
    """Pieces of 64 KiB, 4 in flight: reads in order, backwards, ahead of the window, across the gaps between advised
    ranges, outside them, tiny and larger than the window, each checked against the file's bytes."""
    monkeypatch.setenv("CKPTIO_DIRECT_READS", "force")
    rng = random.Random(5)
    size = 3 * MiB + 777
    data = os.urandom(size)
    (tmp_path / "blob.bin").write_bytes(data)
    folder = Folder(tmp_path)
    served = reading.STATS["bytes"]
    for trial in range(40):
        cuts = sorted(rng.sample(range(size), 8))
        spans = [(cuts[i], cuts[i + 1]) for i in range(0, 8, 2)]
        with folder.open("blob.bin") as handle:
            handle.advise(spans)
            wanted = [(a, rng.randint(a, b) - a) for a, b in spans] if trial % 2 else []
            for _ in range(30):
                a = rng.choice([rng.randrange(size), rng.choice(spans)[0], spans[0][0] + rng.randrange(1 << 20)])
                wanted.append((min(a, size - 1), rng.choice([1, 100, 4096, 70_000, 300_000, 1 << 20])))
            for offset, n in wanted:
                n = min(n, size - offset)
                buf = bytearray(n)
                handle.readinto(buf, offset)
                assert bytes(buf) == data[offset:offset + n], (trial, offset, n)
    assert reading.STATS["bytes"] > served + 10 * MiB  # most of those reads came from the direct pieces


def test_ranges_a_file_claims_beyond_itself_make_no_more_reads_than_the_file_holds(tmp_path, monkeypatch, direct_io):
    """Advised ranges come from a checkpoint's metadata: ranges starting far before the file or ending far past it
    cost pieces for the file's own bytes only, and reads outside it are still refused naming it."""
    from ckptio.storage.reading import FORCED_PIECE, _pieces

    monkeypatch.setenv("CKPTIO_DIRECT_READS", "force")
    size = MiB + 3
    assert len(_pieces(size, [(-(10**18), 10**18)], FORCED_PIECE)) == -(-size // FORCED_PIECE)
    assert _pieces(size, [(10**18, 10**18 + 5), (size, size + 1)], FORCED_PIECE) == []
    data = os.urandom(size)
    (tmp_path / "blob.bin").write_bytes(data)
    with Folder(tmp_path).open("blob.bin") as handle:
        handle.advise([(-(10**18), 10**18)])
        buf = bytearray(size)
        handle.readinto(buf, 0)
        assert bytes(buf) == data
        with pytest.raises(CheckpointCorruptError, match=r"blob\.bin: a read of 4 bytes at"):
            handle.readinto(bytearray(4), size)


def test_a_file_cut_while_it_is_read_is_an_error_naming_it(tmp_path, monkeypatch, direct_io):
    monkeypatch.setenv("CKPTIO_DIRECT_READS", "force")
    (tmp_path / "blob.bin").write_bytes(os.urandom(2 * MiB))
    with Folder(tmp_path).open("blob.bin") as handle:
        handle.advise([(0, 2 * MiB)])
        os.truncate(tmp_path / "blob.bin", MiB + 5)
        first = bytearray(64 << 10)
        handle.readinto(first, 0)  # before the cut: read
        with pytest.raises(CheckpointCorruptError, match=r"blob\.bin: truncated"):
            handle.readinto(bytearray(MiB), MiB - 4096)


def _save(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    model = make_model(seed=0, hidden_size=128, intermediate_size=512, num_hidden_layers=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=tmp_path / "ck"), model=model, optimizer=opt)
    mgr.save(step=1)
    mgr.close()
    return tmp_path / "ck", full_state(model, opt)


def _restore(root: Path) -> dict[str, torch.Tensor]:
    model = make_model(seed=1, hidden_size=128, intermediate_size=512, num_hidden_layers=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt)
    try:
        mgr.restore(verify="full")
    finally:
        mgr.close()
    return full_state(model, opt)


def test_a_cold_restore_reads_around_the_page_cache_a_warm_one_does_not(tmp_path, monkeypatch, direct_io):
    monkeypatch.setenv("CKPTIO_DIRECT_READS", "1")
    monkeypatch.setattr(reading, "MIN_BYTES", 256 << 10)  # the toy's files are a few MiB
    monkeypatch.setattr(reading, "PIECE", 256 << 10)
    root, saved = _save(tmp_path)
    data = sum(p.stat().st_size for p in root.rglob("*.safetensors")) + sum(p.stat().st_size
                                                                           for p in root.rglob("*.distcp"))
    _evict(root)
    (probe,) = root.rglob("*.distcp")
    fd = os.open(probe, os.O_RDONLY)
    try:
        left = reading.cached_fraction(fd, probe.stat().st_size, [(0, probe.stat().st_size)])
    finally:
        os.close(fd)
    if left is None or left >= 0.5:  # tmpfs keeps every page in memory: there, no file is ever cold
        pytest.skip(f"{tmp_path}: files stay in memory after eviction (cached share {left}); nothing here is cold")
    files, served = reading.STATS["files"], reading.STATS["bytes"]
    restored = _restore(root)
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)
    assert reading.STATS["files"] > files and reading.STATS["bytes"] - served > data // 2

    files = reading.STATS["files"]  # direct reads leave nothing in the page cache: a second restore reads around it too
    _restore(root)
    assert reading.STATS["files"] > files
    for path in root.rglob("*"):  # read plainly once: now in the page cache, restored from memory
        if path.is_file():
            path.read_bytes()
    files = reading.STATS["files"]
    _restore(root)
    assert reading.STATS["files"] == files

    for setting in ("0", None):  # off, and off by default
        _evict(root)
        if setting is None:
            monkeypatch.delenv("CKPTIO_DIRECT_READS")
        else:
            monkeypatch.setenv("CKPTIO_DIRECT_READS", setting)
        restored = _restore(root)
        assert reading.STATS["files"] == files and all(torch.equal(restored[k], saved[k]) for k in saved)


def test_damage_in_a_file_read_directly_is_found_by_the_checksums(tmp_path, monkeypatch, direct_io):
    monkeypatch.setenv("CKPTIO_DIRECT_READS", "force")
    root, _ = _save(tmp_path)
    (target,) = root.rglob("*.distcp")
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    target.write_bytes(bytes(raw))
    served = reading.STATS["bytes"]
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp"):
        _restore(root)
    assert reading.STATS["bytes"] > served


def _fsdp_round_trip(root: str, share: bool) -> list[int]:
    """2 FSDP2 ranks save, then restore into fresh objects with every advised range read directly (``force``);
    ``share``: one rank reads what both restore and sends it (shared reads). Returns [exact, bytes read directly]."""
    import torch.distributed as dist
    from toy import fsdp_mlp

    model, opt = fsdp_mlp(512, 3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    cfg = CheckpointConfig(checkpoint_dir=root, share_reads=share)
    CheckpointManager(cfg, model=model, optimizer=opt, rng=False).save(step=1)
    dist.barrier()
    fresh, fresh_opt = fsdp_mlp(512, 3, seed=1)
    served = reading.STATS["bytes"]
    CheckpointManager(cfg, model=fresh, optimizer=fresh_opt, rng=False).restore(verify="full")

    def whole(m, o):
        def full(v):
            return v.full_tensor() if hasattr(v, "full_tensor") else v

        state = {}
        for i, (name, p) in enumerate(m.named_parameters()):
            state[name] = full(p)
            state.update({f"{i}.{k}": full(v) for k, v in o.state[p].items()})
        return state

    a, b = whole(model, opt), whole(fresh, fresh_opt)
    exact = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return [int(exact), reading.STATS["bytes"] - served]


@pytest.mark.slow
@pytest.mark.parametrize("share", [False, True])
def test_two_ranks_restore_exactly_through_direct_reads(tmp_path, monkeypatch, direct_io, share):
    from distributed import run_ranks

    monkeypatch.setenv("CKPTIO_DIRECT_READS", "force")  # the ranks inherit it
    results = run_ranks(2, _fsdp_round_trip, root=str(tmp_path / "ck"), share=share)
    assert all(exact == 1 for exact, _ in results), results
    assert all(direct > 0 for _, direct in results) if not share else sum(d for _, d in results) > 0, results
