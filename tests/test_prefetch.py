"""A restore's own data files brought into the page cache on a thread while it plans and reads
(``storage/reading.Prefetch``, on by default, ``CKPTIO_PREFETCH``): each rank takes exactly the files it wrote when
restored onto as many ranks, only of the states it restores, only local files the page cache does not hold; it
goes through the read gate (a link or a path out of the folder reads nothing), stops when the restore ends or
fails, and never changes what is restored."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.errors import CheckpointCorruptError
from ckptio.storage import reading
from ckptio.storage.confined import Folder
from toy import full_state, make_model

MiB = 1 << 20


def _files(root: Path, names: dict[str, int]) -> Folder:
    for rel, size in names.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    return Folder(root)


def _alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckptio-prefetch"]


def test_each_rank_takes_the_files_it_wrote_when_as_many_ranks_restore(tmp_path):
    folder = _files(tmp_path, {
        "model/shard-00001-model-00001-of-00002.safetensors": 10,
        "model/shard-00001-model-00002-of-00002.safetensors": 10,
        "model/shard-00002-model-00001-of-00001.safetensors": 10, "model/config.json": 5, "model/.ckptio-chunks": 5,
        "optim/__0_0.distcp": 10, "optim/__1_0.distcp": 10, "optim/__1_1.distcp": 10, "optim/.metadata": 5,
        "rng/rank_0.pt": 5,
    })
    assert reading.own_files(folder, ["model", "optim"], 0, 2) == [
        "model/shard-00001-model-00001-of-00002.safetensors", "model/shard-00001-model-00002-of-00002.safetensors",
        "optim/__0_0.distcp"]
    assert reading.own_files(folder, ["model", "optim"], 1, 2) == [
        "model/shard-00002-model-00001-of-00001.safetensors", "optim/__1_0.distcp", "optim/__1_1.distcp"]
    assert reading.own_files(folder, ["optim"], 1, 2) == ["optim/__1_0.distcp", "optim/__1_1.distcp"]  # states asked
    assert reading.own_files(folder, ["model", "optim"], 0, 1) == []  # written by 2 ranks, restored on 1: resharded
    assert reading.own_files(folder, ["model", "optim"], 0, 4) == []
    assert reading.own_files(folder, ["rng", "missing"], 0, 2) == []


def test_links_folders_and_odd_names_are_never_taken(tmp_path):
    folder = _files(tmp_path, {"optim/__0_0.distcp": 10, "outside.bin": 10, "model/shard-00000-model-x.safetensors": 3})
    (tmp_path / "optim" / "__1_0.distcp").symlink_to(tmp_path / "outside.bin")
    (tmp_path / "optim" / "__2_0.distcp").mkdir()
    (tmp_path / "optim" / "__3_0.distcp.tmp").write_bytes(b"x")
    assert reading.own_files(folder, ["optim"], 1, 2) == []  # the link is not a file: rank 1 has nothing
    assert reading.own_files(folder, ["optim"], 0, 1) == ["optim/__0_0.distcp"]
    assert reading.own_files(folder, ["model"], 0, 1) == []  # "shard-00000" names no rank


def test_the_thread_reads_through_the_gate_and_skips_what_is_cached(tmp_path, monkeypatch):
    folder = _files(tmp_path, {"a/__0_0.distcp": 3 * MiB + 5, "outside.bin": 2 * MiB})
    (tmp_path / "a" / "link.distcp").symlink_to(tmp_path / "outside.bin")
    before = dict(reading.STATS)
    with reading.Prefetch(folder, ["a/link.distcp", "../outside.bin", "a/../../x", "a/__0_0.distcp"], True, 1 << 30):
        pass  # closed at once: the small file may or may not be read by then
    with reading.Prefetch(folder, ["a/link.distcp", "../outside.bin", "a/../../x", "a/__0_0.distcp"], True,
                          1 << 30) as p:
        p._thread.join(30)
    assert not _alive()
    got = reading.STATS["prefetched"] - before["prefetched"]
    assert 3 * MiB + 5 <= got <= 2 * (3 * MiB + 5)  # the file itself, never the link's target nor a path outside
    monkeypatch.setenv("CKPTIO_PREFETCH", "1")
    files = reading.STATS["prefetch_files"]
    (tmp_path / "a" / "__0_0.distcp").read_bytes()  # in the page cache now: "auto" leaves it
    with reading.prefetch(folder, ["a"], 0, 1) as p:
        p._thread.join(30)
    assert reading.STATS["prefetch_files"] == files
    with reading.Prefetch(folder, ["a/__0_0.distcp"], False, 1 << 30) as p:
        p._thread.join(30)
    assert reading.STATS["prefetch_files"] == files


def test_the_budget_and_close_stop_it(tmp_path):
    big = tmp_path / "s" / "__0_0.distcp"
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.truncate(8 << 30)  # sparse: reads of holes cost no disk
    folder = Folder(tmp_path)
    before = reading.STATS["prefetched"]
    with reading.Prefetch(folder, ["s/__0_0.distcp"], True, 5 * MiB) as p:
        p._thread.join(30)
    assert reading.STATS["prefetched"] - before == 5 * MiB
    before = reading.STATS["prefetched"]
    p = reading.Prefetch(folder, ["s/__0_0.distcp"], True, 1 << 40)
    deadline = time.monotonic() + 30
    while reading.STATS["prefetched"] == before and time.monotonic() < deadline:
        time.sleep(0.01)  # under way
    t0 = time.perf_counter()
    p.close()
    assert time.perf_counter() - t0 < 5 and not _alive()
    assert 0 < reading.STATS["prefetched"] - before < 8 << 30


def test_the_page_cache_probe_does_not_grow_with_what_a_file_claims(tmp_path):
    import resource

    big, small = tmp_path / "huge.bin", tmp_path / "small.bin"
    with open(big, "wb") as f:
        f.truncate(1 << 40)  # a terabyte that stores nothing
    small.write_bytes(os.urandom(3 * MiB))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for path, size in ((big, 1 << 40), (small, 3 * MiB)):
        fd = os.open(path, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            share = reading.cached_fraction(fd, size, [(-5, 1 << 62)])  # ranges claimed beyond the file, too
            assert time.perf_counter() - t0 < 2
            assert share is None or 0 <= share <= 1
            if path is small:  # just written: in the page cache, whatever the probe's windows
                assert share == 1.0
        finally:
            os.close(fd)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 << 10  # KiB: one byte a page would be 256 MiB


def test_nothing_starts_for_object_storage_or_when_turned_off(tmp_path, monkeypatch):
    folder = _files(tmp_path, {"optim/__0_0.distcp": 10})
    assert not isinstance(reading.prefetch(None, ["optim"], 0, 1), reading.Prefetch)  # a folder in a bucket
    monkeypatch.setenv("CKPTIO_PREFETCH", "0")
    assert reading.prefetch_mode() == "off" and not isinstance(reading.prefetch(folder, ["optim"], 0, 1),
                                                                 reading.Prefetch)
    monkeypatch.setenv("CKPTIO_PREFETCH", "force")
    monkeypatch.setenv("CKPTIO_DIRECT_READS", "1")  # direct reads read around the page cache: no prefetch then
    assert reading.prefetch_mode() == ("off" if reading.mode() != "off" else "force")


def _save(root: Path) -> tuple[Path, dict[str, torch.Tensor], int]:
    model = make_model(seed=0, hidden_size=128, intermediate_size=512, num_hidden_layers=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt) as mgr:
        step = mgr.save(step=1)
    own = sum(p.stat().st_size for p in Path(step).rglob("*") if p.name.endswith((".distcp", ".safetensors")))
    return root, full_state(model, opt), own


def _restore(root: Path, **config) -> dict[str, torch.Tensor]:
    model = make_model(seed=1, hidden_size=128, intermediate_size=512, num_hidden_layers=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root, **config), model=model, optimizer=opt) as mgr:
        mgr.restore(verify="full")
    return full_state(model, opt)


def test_a_restore_prefetches_its_files_and_is_exact(tmp_path, monkeypatch):
    root, saved, own = _save(tmp_path / "ck")
    monkeypatch.setenv("CKPTIO_PREFETCH", "force")  # the files are in the page cache just after the save
    before = reading.STATS["prefetched"]
    restored = _restore(root)
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)
    assert reading.STATS["prefetched"] - before == own and not _alive()
    before = reading.STATS["prefetched"]
    _restore(root, load_states=["model"])  # the optimizer's files are not read, nor prefetched
    model_bytes = sum(p.stat().st_size for p in root.rglob("*.safetensors"))
    assert reading.STATS["prefetched"] - before == model_bytes and 0 < model_bytes < own
    before = reading.STATS["prefetched"]
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=make_model(
            seed=1, hidden_size=128, intermediate_size=512, num_hidden_layers=3)) as mgr:
        mgr.restore()  # no optimizer to restore: its files are left alone
    # a restore this small (no full verify) may end before the thread is scheduled, which stops it: at most the model
    assert reading.STATS["prefetched"] - before <= model_bytes
    monkeypatch.setenv("CKPTIO_PREFETCH", "0")
    before = reading.STATS["prefetched"]
    restored = _restore(root)
    assert reading.STATS["prefetched"] == before and all(torch.equal(restored[k], saved[k]) for k in saved)


def test_a_failed_restore_leaves_no_thread_behind(tmp_path, monkeypatch):
    root, _, _ = _save(tmp_path / "ck")
    (target,) = root.rglob("__0_0.distcp")
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    target.write_bytes(bytes(raw))
    monkeypatch.setenv("CKPTIO_PREFETCH", "force")
    before = reading.STATS["prefetch_files"]
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp"):
        _restore(root)
    assert reading.STATS["prefetch_files"] > before and not _alive()


def test_a_cold_restore_prefetches_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTIO_PREFETCH", raising=False)
    monkeypatch.delenv("CKPTIO_DIRECT_READS", raising=False)
    root, saved, own = _save(tmp_path / "ck")
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                left = reading.cached_fraction(fd, path.stat().st_size, [(0, path.stat().st_size)])
            finally:
                os.close(fd)
    if left is None or left >= 0.5:  # tmpfs keeps every page in memory: there, no file is ever cold
        pytest.skip(f"{tmp_path}: files stay in memory after eviction (cached share {left}); nothing here is cold")
    before = reading.STATS["prefetched"]
    restored = _restore(root)
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert reading.STATS["prefetched"] - before == own


def _two_ranks(root: str) -> list[int]:
    """2 FSDP2 ranks save, then restore into fresh objects with the prefetch forced: [exact, bytes prefetched,
    bytes of the files this rank wrote]."""
    import torch.distributed as dist
    from toy import fsdp_mlp

    model, opt = fsdp_mlp(512, 3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    cfg = CheckpointConfig(checkpoint_dir=root)
    step = Path(CheckpointManager(cfg, model=model, optimizer=opt, rng=False).save(step=1))
    dist.barrier()
    rank = dist.get_rank()
    mine = [*step.glob(f"optim/__{rank}_*.distcp"), *step.glob(f"model/shard-{rank + 1:05d}-*.safetensors"),
            *step.glob(f"model/__{rank}_*.distcp")]
    fresh, fresh_opt = fsdp_mlp(512, 3, seed=1)
    before = reading.STATS["prefetched"]
    CheckpointManager(cfg, model=fresh, optimizer=fresh_opt, rng=False).restore(verify="full")
    exact = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters()))
    exact = exact and all(torch.equal(opt.state[a][k].full_tensor(), fresh_opt.state[b][k].full_tensor())
                          for a, b in zip(model.parameters(), fresh.parameters()) for k in ("exp_avg", "exp_avg_sq"))
    return [int(exact), reading.STATS["prefetched"] - before, sum(p.stat().st_size for p in mine)]


@pytest.mark.slow
def test_two_ranks_each_prefetch_their_own_files(tmp_path, monkeypatch):
    from distributed import run_ranks

    monkeypatch.setenv("CKPTIO_PREFETCH", "force")  # the ranks inherit it
    results = run_ranks(2, _two_ranks, root=str(tmp_path / "ck"))
    assert all(exact == 1 for exact, _, _ in results), results
    assert all(got == mine > 0 for _, got, mine in results), results
