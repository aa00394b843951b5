"""Each stored byte read once: parts several ranks restore are read by one and sent to the others
(ckptio.engine.shared_reads), with every byte still checksummed (the verifier's runs, joined by each file's
finisher)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.engine.shared_reads import PACK, Described, describe, plans
from ckptio.errors import CheckpointCorruptError
from ckptio.storage.checksum import file_checksum
from ckptio.storage.confined import Folder
from ckptio.storage.verify import Verifier, finishers
from distributed import run_ranks

MiB = 1 << 20


# ---------------------------------------------------------------------------------------- the plan
def _need(key: str, nbytes: int, offsets=(0,), device="cpu"):
    return (key, offsets, (nbytes // 4,), "torch.float32", nbytes, device)


def _plans(everyone, setting=True, hosts=None, remote=False):
    """Each rank's model plan, ``everyone[r]`` being rank r's (whole tensors, parts of tensors) or None."""
    described = [Described([*(lists or (None, None)), None, None], (hosts or ["node"] * len(everyone))[r])
                 for r, lists in enumerate(everyone)]
    summaries = [d.summary() if everyone[r] is not None else None for r, d in enumerate(described)]
    return [plans(summaries, described[r] if everyone[r] is not None else None, r, setting, remote=remote)[0]
            for r in range(len(everyone))]


def test_a_part_every_rank_needs_is_read_by_one_and_the_load_is_even():
    needs = [_need(f"w{i}", (i + 1) * MiB) for i in range(8)]  # 36 MiB in all
    got = _plans([(needs, []), (needs, [])])
    read = [{n[0] for n in needs} - p.skip_keys for p in got]
    assert read[0] & read[1] == set() and read[0] | read[1] == {n[0] for n in needs}
    sizes = {n[0]: n[4] for n in needs}
    assert abs(sum(sizes[k] for k in read[0]) - sum(sizes[k] for k in read[1])) <= 8 * MiB
    assert got[0].shared_bytes == 36 * MiB
    assert got[0].messages == got[1].messages  # both ranks take part in every message, with the same tags
    sent = Counter(k for m in got[0].messages for k in m.keys)
    assert set(sent.values()) == {1} and set(sent) == set(sizes)  # each part sent once, by the rank that read it
    for m in got[0].messages:
        assert all(k in read[m.src] for k in m.keys) and m.dsts == (1 - m.src,)
    assert len({m.tag for m in got[0].messages}) == len(got[0].messages)


def test_only_identical_lists_are_shared_and_small_parts_are_packed():
    small = [_need(f"norm{i}", 64) for i in range(5)]
    rank0, rank1 = [_need("w", 4 * MiB, offsets=(0,))], [_need("w", 4 * MiB, offsets=(MiB,))]
    got = _plans([(small, rank0), (small, rank1), None])  # rank 2 does not share: nobody does
    assert not any(p.messages or p.skip_keys for p in got)
    got = _plans([(small, rank0), (small, rank1)])
    assert all("w" not in p.skip_keys for p in got)  # each shard read by its own rank
    packed = [m for m in got[0].messages if m.packed]
    assert sum(len(m.keys) for m in packed) == 5 and all(m.nbytes < PACK for m in packed)
    assert len(got[0].skip_keys) + len(got[1].skip_keys) == 5


def test_replica_groups_share_among_themselves_with_tags_of_their_own():
    a, b = [_need("w", 8 * MiB, offsets=(0,))], [_need("w", 8 * MiB, offsets=(2 * MiB,))]
    steps = [_need(f"step{i}", 4) for i in range(3)]
    got = _plans([(steps, a), (steps, b), (steps, a), (steps, b)])  # HSDP: ranks 0 and 2 hold one shard, 1 and 3 the other
    assert sorted(len(p.skip_keys - {n[0] for n in steps}) for p in got) == [0, 0, 1, 1]
    for p in got:
        for m in p.messages:
            assert m.keys[0].startswith("step") or {m.src, *m.dsts} in ({0, 2}, {1, 3})
    # the step counters are one group of all four, the shards two groups of two: tags never collide
    for r, p in enumerate(got):
        pairs = Counter((m.src, d, m.tag) for m in p.messages for d in m.dsts)
        assert max(pairs.values()) == 1


def test_the_digests_are_what_travels_not_the_lists():
    needs = [_need(f"w{i}", 4096) for i in range(2000)]
    summary = Described([needs, [], None, None], "node").summary()
    assert len(repr(summary)) < 200


def test_describe_lists_whole_tensors_then_parts():
    flat = {"w": torch.zeros(3, 4), "empty": torch.zeros(0), "lr": 0.1, "step": torch.tensor(3.0)}
    assert describe(flat) == ([("w", (0, 0), (3, 4), "torch.float32", 48, "cpu"),
                               ("step", (), (), "torch.float32", 4, "cpu")], [])


# ---------------------------------------------------------------------------------------- hashing in runs
def test_ranks_reading_parts_of_a_file_each_hash_runs_and_the_finisher_reads_only_the_rest(tmp_path):
    size = 20 * MiB + 777
    data = os.urandom(size)
    (tmp_path / "blob.bin").write_bytes(data)
    digest = file_checksum(tmp_path / "blob.bin")
    cut = [0, 3 * MiB, 9 * MiB + 5, 15 * MiB, size]  # ranks alternate over the file's parts
    verifiers = [Verifier(Folder(tmp_path), {"blob.bin": digest}) for _ in range(2)]
    for i, (lo, hi) in enumerate(zip(cut, cut[1:])):
        v = verifiers[i % 2]
        with Folder(tmp_path, verifier=v).open("blob.bin") as handle:
            if lo:  # a record's head and tail first (zip readers do), then its body
                handle.readinto(bytearray(4096), lo)
                handle.readinto(bytearray(4096), hi - 4096)
            out = torch.empty(hi - lo, dtype=torch.uint8)
            handle.readinto(memoryview(out.numpy()), lo, settle=False)
            assert bytes(out.numpy()) == data[lo:hi]
    runs = [v.runs() for v in verifiers]
    assert sum(n for r in runs for _, n, _ in r["blob.bin"]) >= size
    owner = finishers(runs).index(["blob.bin"])
    read_again = []
    shared = {"blob.bin": [run for r in runs for run in r["blob.bin"]]}
    assert verifiers[owner].finish(shared, progress=read_again.append) == []
    assert sum(read_again) == 0  # every byte was hashed by some rank as it was read
    # damage in a part the other verifier read is found by the finisher
    bad = bytearray(data)
    bad[cut[1] + 100] ^= 1
    (tmp_path / "blob.bin").write_bytes(bytes(bad))
    v = Verifier(Folder(tmp_path), {"blob.bin": digest})
    with Folder(tmp_path, verifier=v).open("blob.bin") as handle:
        handle.readinto(bytearray(cut[2] - cut[1]), cut[1])
    mine = {"blob.bin": runs[0]["blob.bin"] + v.runs()["blob.bin"]}
    problems = verifiers[0].finish(mine)
    assert len(problems) == 1 and "blob.bin" in problems[0]


# ---------------------------------------------------------------------------------------- real ranks
def _mlp(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _counting_reads(under: str) -> Counter:
    """Bytes read by ``os.preadv`` from the data files under ``under`` in this process, by file name."""
    counts: Counter = Counter()
    real = os.preadv

    def preadv(fd, buffers, offset, *args):
        got = real(fd, buffers, offset, *args)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(under) and path.endswith((".safetensors", ".distcp")):
            counts[Path(path).name] += got
        return got

    os.preadv = preadv
    return counts


def _ddp_restore(root: str, share: bool, damage: str | None = None, optim_format: str = "torch_save") -> dict:
    import torch.distributed as dist

    model, opt = _mlp(768, 3)  # every rank holds all of it, as under DDP; 2.25 MiB weights, small biases
    model(torch.randn(4, 768)).sum().backward()
    opt.step()
    cfg = CheckpointConfig(checkpoint_dir=root, share_reads=share, optimizer_save_format=optim_format)
    CheckpointManager(cfg, model=model, optimizer=opt, rng=False).save(step=1)
    step = Path(root) / "epoch_0_step_1"
    dist.barrier()
    if damage is not None and dist.get_rank() == 0:
        victim = next(step.rglob(damage))
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        victim.write_bytes(bytes(raw))
    dist.barrier()
    fresh, fresh_opt = _mlp(768, 3)
    for p in fresh.parameters():
        torch.nn.init.zeros_(p)
    counts = _counting_reads(str(step))
    try:
        CheckpointManager(cfg, model=fresh, optimizer=fresh_opt, rng=False).restore(str(step))
    except CheckpointCorruptError as exc:
        return {"error": str(exc)}
    sizes = {p.name: p.stat().st_size for p in step.rglob("*") if p.suffix in (".safetensors", ".distcp")}
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    same_opt = all(torch.equal(saved[i][k], loaded[i][k]) for i in saved for k in saved[i])
    return {"same": same and same_opt, "read": dict(counts), "sizes": sizes}


@pytest.mark.slow
@pytest.mark.parametrize("optim_format", ["torch_save", "safetensors"])
def test_a_ddp_restore_on_two_ranks_reads_each_byte_once_and_is_bitwise(tmp_path, optim_format):
    shared = run_ranks(2, _ddp_restore, root=str(tmp_path / "shared"), share=True, optim_format=optim_format)
    alone = run_ranks(2, _ddp_restore, root=str(tmp_path / "alone"), share=False, optim_format=optim_format)
    assert all(r["same"] for r in shared + alone)
    size = sum(shared[0]["sizes"].values())
    read_shared = sum(sum(r["read"].values()) for r in shared)
    read_alone = sum(sum(r["read"].values()) for r in alone)
    assert read_alone >= 1.9 * size  # each rank read everything
    assert read_shared <= size + 256 * 1024, (read_shared, size, [r["read"] for r in shared])
    assert all(sum(r["read"].values()) >= size / 4 for r in shared)  # both ranks read a fair part


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["*.safetensors", "*.distcp"])
def test_damage_in_bytes_another_rank_read_fails_the_restore_on_every_rank(tmp_path, victim):
    out = run_ranks(2, _ddp_restore, root=str(tmp_path / "ck"), share=True, damage=victim)
    assert all("error" in r for r in out), out
    assert all("checksum" in r["error"] for r in out), out


def _hsdp_restore(root: str, share: bool) -> dict:
    """HSDP on 4 ranks: two replica groups, each sharding the model over 2 ranks (ranks 0 and 2 hold the same
    shards, as do 1 and 3): each replicated shard is read by one rank of its pair."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    cfg = CheckpointConfig(checkpoint_dir=root, share_reads=share)
    CheckpointManager(cfg, model=model, optimizer=opt, rng=False).save(step=1)
    step = Path(root) / "epoch_0_step_1"
    dist.barrier()
    fresh, fresh_opt = build()
    counts = _counting_reads(str(step))
    CheckpointManager(cfg, model=fresh, optimizer=fresh_opt, rng=False).restore(str(step))
    sizes = {p.name: p.stat().st_size for p in step.rglob("*") if p.suffix in (".safetensors", ".distcp")}
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), fresh.parameters()))
    saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    same_opt = all(torch.equal(getattr(saved[i][k], "to_local", lambda v=saved[i][k]: v)(),
                               getattr(loaded[i][k], "to_local", lambda v=loaded[i][k]: v)()) for i in saved for k in saved[i])
    return {"same": same and same_opt, "read": sum(counts.values()), "size": sum(sizes.values())}


@pytest.mark.slow
def test_hsdp_replica_groups_share_their_reads_on_four_ranks(tmp_path):
    out = run_ranks(4, _hsdp_restore, root=str(tmp_path / "shared"), share=True)
    alone = run_ranks(4, _hsdp_restore, root=str(tmp_path / "alone"), share=False)
    assert all(r["same"] for r in out + alone), (out, alone)
    size = out[0]["size"]
    # not twice: each pair read its shards once (the DCP reader's small look-ahead reads of each record aside)
    assert sum(r["read"] for r in alone) >= 1.9 * size, alone
    assert sum(r["read"] for r in out) <= 1.06 * size, out
    assert all(r["read"] > 0 for r in out), out


def test_the_automatic_setting_shares_across_hosts_or_from_a_bucket_only():
    need = [_need("w", 4 * MiB)]
    both = [(need, []), (need, [])]
    assert not any(p.messages for p in _plans(both, None))  # one host: its page cache serves both ranks
    assert _plans(both, None, remote=True)[0].messages
    assert _plans(both, None, hosts=["node-a", "node-b"])[0].messages
    assert _plans(both, True)[0].messages and not _plans(both, False, remote=True)[0].messages


def test_parts_are_not_described_where_they_cannot_be_shared(monkeypatch):
    from ckptio import _dist
    from ckptio.engine.shared_reads import may_share

    monkeypatch.setattr(_dist, "world_size", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: both ranks on this node
    assert not may_share(None, remote=False) and may_share(None, remote=True) and may_share(True, remote=False)
    assert not may_share(False, remote=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank per node
    assert may_share(None, remote=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not told: the hosts decide in the opening round
    assert may_share(None, remote=False)
    monkeypatch.setattr(_dist, "world_size", lambda: 1)
    assert not may_share(True, remote=True)


def _s3_restore(url: str, share: bool | None) -> dict:
    import torch.distributed as dist

    from ckptio.storage.s3 import client
    from ckptio.storage.s3.reader import S3ReadHandle

    model, opt = _mlp(768, 3)
    model(torch.randn(4, 768)).sum().backward()
    opt.step()
    cfg = CheckpointConfig(checkpoint_dir=url, share_reads=share)
    CheckpointManager(cfg, model=model, optimizer=opt, rng=False).save(step=1)
    dist.barrier()
    fetched = Counter()
    real = S3ReadHandle._get

    def get(handle, view, offset):
        real(handle, view, offset)
        if str(handle.path).endswith((".safetensors", ".distcp")):
            fetched["data"] += view.nbytes

    S3ReadHandle._get = get
    fresh, fresh_opt = _mlp(768, 3)
    for p in fresh.parameters():
        torch.nn.init.zeros_(p)
    CheckpointManager(cfg, model=fresh, optimizer=fresh_opt, rng=False).restore()
    bucket, _, prefix = url[len("s3://"):].partition("/")
    listed = client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]
    size = sum(o["Size"] for o in listed if o["Key"].endswith((".safetensors", ".distcp")))
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    same = same and all(torch.equal(saved[i][k], loaded[i][k]) for i in saved for k in saved[i])
    return {"same": same, "fetched": fetched["data"], "size": size}


@pytest.mark.slow
def test_a_restore_from_a_bucket_on_two_ranks_fetches_each_byte_once_by_default(bucket):
    shared = run_ranks(2, _s3_restore, url=f"s3://{bucket}/auto", share=None)  # automatic: a bucket is shared
    alone = run_ranks(2, _s3_restore, url=f"s3://{bucket}/alone", share=False)
    assert all(r["same"] for r in shared + alone)
    size = shared[0]["size"]
    assert sum(r["fetched"] for r in alone) >= 1.9 * size, alone
    assert sum(r["fetched"] for r in shared) <= 1.02 * size, shared
    assert all(r["fetched"] > size / 4 for r in shared), shared


def test_share_reads_takes_true_false_or_null_only():
    from ckptio.errors import ConfigError

    for ok in (True, False, None):
        assert CheckpointConfig(share_reads=ok).share_reads is ok
    with pytest.raises(ConfigError, match="share_reads must be true, false or null"):
        CheckpointConfig(share_reads="yes")


# ------------------------------------------------------------------------------ reads overlap sends
def _exchange_plans(rank: int) -> tuple[dict, Any]:
    """Two ranks that both restore ``a`` and ``b`` (2 MiB each, sent from and into their own memory) and eight small
    parts (packed): rank 0 reads the first half, rank 1 the second."""
    flat = {"a": torch.zeros(MiB // 2), "b": torch.zeros(MiB // 2)} | {f"s{i}": torch.zeros(16) for i in range(8)}
    mine = Described([[_need(k, t.numel() * 4) for k, t in flat.items()], None, None, None], "node")
    summaries = [mine.summary()] * 2
    return flat, plans(summaries, mine, rank, True, remote=False)[0]


def _wait_for(t: torch.Tensor, value: float, seconds: float = 30) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if bool((t == value).all()):
            return True
        time.sleep(0.01)
    return False


def _overlapping() -> dict:
    """Each rank fills what it reads, says so, and waits, still inside its reads, for the other rank's part."""
    import torch.distributed as dist

    rank = dist.get_rank()
    flat, plan = _exchange_plans(rank)
    read, other = ("a", "b") if rank == 0 else ("b", "a")
    assert {k for k in flat if k not in plan.skip_keys} >= {read}
    with plan.exchange(flat) as extra:
        assert id(flat[other]) in extra["skip"]
        flat[read].fill_(rank + 1)
        extra["filled"](id(flat[read]))
        arrived = _wait_for(flat[other], 2 - rank)  # rank 0 waits for rank 1's part, and the other way round
        for k in flat:  # the small parts, then the end of the reads
            if k not in plan.skip_keys and k != read:
                flat[k].fill_(rank + 1)
                extra["filled"](id(flat[k]))
    small = {k: float(v[0]) for k, v in flat.items() if k.startswith("s")}
    return {"arrived": arrived, "small": small, "other": float(flat[other][0])}


def test_a_part_is_sent_as_soon_as_it_is_read_not_after_every_read():
    out = run_ranks(2, _overlapping)
    assert all(r["arrived"] for r in out), out  # each part reached the other rank while its reads went on
    assert out[0]["small"] == out[1]["small"] and set(out[0]["small"].values()) <= {1.0, 2.0}, out


def _failing_then_fine() -> dict:
    """Rank 0's reads fail before it filled anything; the exchange still ends on both ranks (no receive left
    waiting), and a second exchange with the same tags delivers the right bytes."""
    import torch.distributed as dist

    rank = dist.get_rank()
    flat, plan = _exchange_plans(rank)
    error = None
    try:
        with plan.exchange(flat) as extra:
            if rank == 0:
                raise OSError("the disk went away")
            for k in flat:
                if k not in plan.skip_keys:
                    flat[k].fill_(7)
                    extra["filled"](id(flat[k]))
    except OSError as exc:
        error = str(exc)
    flat, plan = _exchange_plans(rank)
    with plan.exchange(flat) as extra:
        for k in flat:
            if k not in plan.skip_keys:
                flat[k].fill_(rank + 1)
                extra["filled"](id(flat[k]))
    return {"error": error, "values": {k: float(v[0]) for k, v in flat.items()},
            "uniform": all(bool((v == v[0]).all()) for v in flat.values())}


def test_a_failed_read_still_ends_the_exchange_and_leaves_nothing_to_catch_the_next():
    out = run_ranks(2, _failing_then_fine, timeout=120)
    assert out[0]["error"] == "the disk went away" and out[1]["error"] is None
    assert out[0]["values"] == out[1]["values"], out  # both ranks hold what its reader read, key by key
    assert out[0]["values"]["a"] == 1.0 and out[0]["values"]["b"] == 2.0, out
    assert all(r["uniform"] for r in out), out


def _truncated_then_intact(root: str) -> dict:
    import torch.distributed as dist

    model, opt = _mlp(768, 3)
    model(torch.randn(4, 768)).sum().backward()
    opt.step()
    cfg = CheckpointConfig(checkpoint_dir=root, share_reads=True)
    with CheckpointManager(cfg, model=model, optimizer=opt, rng=False) as manager:
        manager.save(step=1)
        manager.save(step=2)
    damaged = Path(root) / "epoch_0_step_1"
    dist.barrier()
    if dist.get_rank() == 0:
        for victim in damaged.rglob("*.distcp"):  # found once the optimizer's parts are awaited from the other rank
            os.truncate(victim, victim.stat().st_size // 2)
    dist.barrier()
    fresh, fresh_opt = _mlp(768, 3)
    error = None
    try:
        CheckpointManager(cfg, model=fresh, optimizer=fresh_opt, rng=False).restore(str(damaged), verify="none")
    except CheckpointCorruptError as exc:
        error = str(exc)
    fresh, fresh_opt = _mlp(768, 3)
    for p in fresh.parameters():
        torch.nn.init.zeros_(p)
    CheckpointManager(cfg, model=fresh, optimizer=fresh_opt, rng=False).restore(str(Path(root) / "epoch_0_step_2"))
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    same_opt = all(torch.equal(saved[i][k], loaded[i][k]) for i in saved for k in saved[i])
    return {"error": error, "same": same and same_opt}


@pytest.mark.slow
def test_a_restore_failing_amid_shared_reads_fails_every_rank_and_the_next_restore_is_exact(tmp_path):
    out = run_ranks(2, _truncated_then_intact, root=str(tmp_path / "ck"), timeout=180)
    assert all(r["error"] and ".distcp" in r["error"] for r in out), out
    assert all(r["same"] for r in out), out
