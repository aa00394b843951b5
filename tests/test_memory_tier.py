"""The memory tier: snapshots in node-local memory, replicated on the next node, restored before the durable tier.

The multi-node cases run real jobs: two ``torchrun`` "nodes" of 2 ranks on 127.0.0.1, each with its own memory
folder (``CKPTIO_MEMORY_DIR``) and no folder in common for the memory tier (the durable tier is a local folder).
The job trains the tiny Llama for 12 steps with a memory snapshot every 2 steps and a durable save every 6; an
uninterrupted run records the whole state at every save and at the end. Interrupted runs must end bitwise equal
to it, having lost at most 2 steps, whichever way they were interrupted.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from distributed import free_port, kill_group, wait_or_kill  # noqa: E402

from ckptio import CheckpointConfig, ConfigError  # noqa: E402
from ckptio.tier.memory import Nodes, pick  # noqa: E402
from ckptio.tier.node import Held  # noqa: E402

WORKER = Path(__file__).with_name("memory_node_worker.py")
COMMON = ("--steps", "12", "--memory-every", "2", "--persist-every", "6")


# ------------------------------------------------------------------------------------------------- the plan
def test_each_rank_replicates_to_the_same_local_rank_on_the_next_node():
    nodes = Nodes(["a", "a", "b", "b"])
    assert [nodes.peer(r) for r in range(4)] == [2, 3, 0, 1]
    assert [nodes.leader(r) for r in range(4)] == [0, 0, 2, 2]
    uneven = Nodes(["a", "a", "b", "c", "c", "c"])
    assert [uneven.peer(r) for r in range(6)] == [2, 2, 3, 0, 1, 0]
    alone = Nodes(["a", "a"])
    assert {alone.ids[alone.peer(r)] for r in range(2)} == {"a"}  # one node: its folder is shared, nothing is sent


def _held(step: int, files: list[str], total: int = 3, run: str = "r", base: int | None = None, digest: str = "d"):
    return Held(step, f"{digest}{step}", 2, files, {"run": run, "durable_step": base} if "memory_tier.json" in files
                else None, {"total": total, "manifest_size": 10})


def test_the_newest_snapshot_whole_on_the_surviving_nodes_is_chosen():
    everyone = [{"s8": _held(8, ["a", "memory_tier.json"]), "s10": _held(10, ["a", "memory_tier.json"])},
                {"s8": _held(8, ["b"])}]
    choice, message = pick(everyone, "r", durable_step=6)
    assert choice == ("s8", "d8")
    assert "s10 is incomplete: 1 of its 3 files are on no surviving node" in message
    assert pick(everyone, "r", durable_step=8)[0] is None  # the durable tier is as new: it is taken
    assert "as new" in pick(everyone, "r", durable_step=9)[1]


def test_a_snapshot_of_another_run_or_of_a_run_whose_durable_checkpoints_are_gone_is_refused():
    theirs = [{"s8": _held(8, ["a", "b", "memory_tier.json"], run="other")}]
    assert pick(theirs, "r", None) == (None, "Memory tier: no usable snapshot (snapshot s8 belongs to another run); "
                                             "restoring from the durable tier")
    stale = [{"s8": _held(8, ["a", "b", "memory_tier.json"], base=6)}]
    choice, message = pick(stale, "r", durable_step=None)
    assert choice is None and "follows the durable checkpoint of step 6" in message
    assert pick(stale, "r", durable_step=6)[0] == ("s8", "d8")


def test_two_nodes_disagreeing_on_a_snapshot_of_the_same_name_are_two_snapshots():
    everyone = [{"s8": _held(8, ["a", "memory_tier.json"], digest="x")}, {"s8": _held(8, ["b"], digest="y")}]
    assert pick(everyone, "r", None)[0] is None


# ------------------------------------------------------------------------------------------------- one process
def _train(run, to: int) -> None:
    run.train(stop_at=to, after_step=run.mgr.maybe_save)


@pytest.fixture
def memory(tmp_path, monkeypatch):
    folder = tmp_path / "shm"
    monkeypatch.setenv("CKPTIO_MEMORY_DIR", str(folder))
    return folder


def _same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys() and len([k for k in a if k.startswith("optim/")]) > 10, where
    for k in a:
        assert torch.equal(a[k], b[k]), f"{where}: {k} differs"


def test_a_snapshot_newer_than_the_durable_checkpoint_resumes_bitwise_and_close_frees_it(tmp_path, memory, caplog):
    from toy import Run, full_state

    run = Run(tmp_path / "ckpt", max_steps=20, memory_every_steps=2, persist_every_steps=5)
    _train(run, 8)
    run.mgr.wait()
    held = sum(f.lstat().st_blocks * 512 for f in memory.rglob("*") if f.is_file())  # pages, not file sizes
    figures = run.mgr.memory_tier.last
    assert figures["step"] == 8 and figures["node_bytes"] == held > 0, "the memory used is what the tier reports"
    assert any(f"{held / 1e6:.1f} MB on this node" in r.message for r in caplog.records)
    expected = full_state(run.model, run.opt)
    _train(run, 9)
    with pytest.raises(RuntimeError):
        with run.mgr:
            raise RuntimeError("the training loop died")
    assert sorted(p.name for p in next(memory.iterdir()).iterdir()) == ["epoch_0_step_8", "node-id"]

    again = Run(tmp_path / "ckpt", max_steps=20, memory_every_steps=2, persist_every_steps=5)
    info = again.mgr.restore()
    assert (info.step, info.tier) == (8, "memory") and info.path.parent.parent == memory
    _same(expected, full_state(again.model, again.opt), "restored from memory")
    again.mgr.close()
    assert not any(memory.iterdir()), "a clean close frees the memory tier"


def test_the_durable_checkpoint_wins_when_newer_and_a_damaged_snapshot_falls_back(tmp_path, memory, caplog):
    from toy import Run

    run = Run(tmp_path / "ckpt", max_steps=20, memory_every_steps=2, persist_every_steps=5)
    _train(run, 5)
    run.mgr.close(free_memory=False)
    info = Run(tmp_path / "ckpt", max_steps=20, memory_every_steps=2, persist_every_steps=5).mgr.restore()
    assert (info.step, info.tier) == (5, "durable")  # the snapshot of step 4 is older

    run = Run(tmp_path / "ckpt", max_steps=20, memory_every_steps=2, persist_every_steps=5)
    run.mgr.restore()
    _train(run, 8)
    run.mgr.close(free_memory=False)
    snapshot = next(memory.iterdir()) / "epoch_0_step_8"
    shard = next((snapshot / "optim").glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    os.chmod(shard, stat.S_IWUSR | stat.S_IRUSR)
    shard.write_bytes(bytes(data))
    caplog.clear()
    info = Run(tmp_path / "ckpt", max_steps=20, memory_every_steps=2, persist_every_steps=5).mgr.restore()
    assert (info.step, info.tier) == (5, "durable")
    assert any("could not be restored" in r.message and "falling back to the durable tier" in r.message and
               shard.name in r.message for r in caplog.records)


def test_a_snapshot_of_another_run_in_the_same_memory_folder_is_never_read(tmp_path, memory):
    from toy import Run

    run = Run(tmp_path / "a", max_steps=20, memory_every_steps=2, persist_every_steps=5)
    _train(run, 8)
    run.mgr.close(free_memory=False)
    assert Run(tmp_path / "b", max_steps=20, memory_every_steps=2).mgr.restore() is None
    shutil.rmtree(tmp_path / "a")  # the durable checkpoints are gone: a new run in that folder starts afresh
    assert Run(tmp_path / "a", max_steps=20, memory_every_steps=2).mgr.restore() is None


def test_a_memory_folder_others_could_write_is_refused(tmp_path):
    from toy import Run

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="can be written by other users"):
        Run(tmp_path / "ckpt", memory_every_steps=2, memory_dir=str(shared)).mgr.restore()
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        Run(tmp_path / "ckpt", memory_every_steps=2, memory_dir=str(tmp_path / "link")).mgr.restore()
    with pytest.raises(ConfigError, match="memory_every_steps must be a positive integer"):
        CheckpointConfig(memory_every_steps=0)


# ------------------------------------------------------------------------------------------------- nodes
def _job(base: Path, node: int, nodes: int, ranks: int, port: int, *args: str, restarts: int = 0) -> subprocess.Popen:
    env = {**os.environ, "CKPTIO_MEMORY_DIR": str(base / f"mem{node}"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "CKPTIO_TOY_MODEL": "plain"}
    log = open(base / f"log{node}.txt", "a")
    launch = ["--standalone"] if nodes == 1 else [f"--nnodes={nodes}", f"--node-rank={node}",
                                                 "--master-addr=127.0.0.1", f"--master-port={port}"]
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc-per-node={ranks}",
                             f"--max-restarts={restarts}",
                             str(WORKER), "--ckpt", str(base / "ckpt"), *COMMON, "--out", str(base / f"out{node}"),
                             *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait(proc: subprocess.Popen, base: Path, timeout: float = 300) -> int:
    return wait_or_kill(proc, timeout, lambda: _logs(base))


def _logs(base: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(base.glob("log*.txt")))


def _run(base: Path, ranks: tuple[int, ...] = (2, 2), every: tuple[str, ...] = (), restarts: int = 0) -> None:
    port = free_port()
    procs = [_job(base, i, len(ranks), n, port, *every, restarts=restarts) for i, n in enumerate(ranks)]
    for proc in procs:
        assert _wait(proc, base) == 0, f"job failed:\n{_logs(base)}"


def _lose_node1(base: Path, *node1: str) -> None:
    """Run the job until node 1's ranks die as told; then take node 0 down as a scheduler would."""
    port = free_port()
    node0, node1_ = _job(base, 0, 2, 2, port), _job(base, 1, 2, 2, port, *node1)
    assert _wait(node1_, base) != 0, f"node 1 was to die:\n{_logs(base)}"
    time.sleep(1)
    kill_group(node0)  # the scheduler takes the rest of the job down


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted job on 2 nodes: the state at every save, and at the end."""
    base = tmp_path_factory.mktemp("reference")
    _run(base, every=("--dump",))
    assert not any((base / "mem0").iterdir()) and not any((base / "mem1").iterdir()), "a clean end frees the tier"
    return {**{s: torch.load(base / "out0" / f"state_{s}.pt") for s in (2, 4, 6, 8, 10, 12)},
            "final": torch.load(base / "out0" / "final.pt")["state"]}


def _restored(base: Path) -> dict:
    return torch.load(base / "out0" / "restored.pt")


def _reset(base: Path, backup: Path) -> None:
    """The folders as the interrupted job left them (the run's identity is its checkpoint folder's path)."""
    for name in ("ckpt", "mem0", "mem1", "out0", "out1"):
        shutil.rmtree(base / name, ignore_errors=True)
        if (backup / name).exists():
            shutil.copytree(backup / name, base / name, symlinks=True)
    for log in base.glob("log*.txt"):
        log.unlink()


@pytest.mark.slow
def test_a_lost_node_resumes_from_memory_bitwise_when_replaced_on_three_ranks_and_else_from_durable(tmp_path,
                                                                                                     reference):
    base, backup = tmp_path / "job", tmp_path / "backup"
    base.mkdir()
    _lose_node1(base, "--die-at", "9")  # snapshot of step 8 committed, durable step 6; step 9 is lost
    shutil.copytree(base, backup, symlinks=True)

    _run(base)
    assert (_restored(base)["step"], _restored(base)["tier"]) == (8, "memory"), _logs(base)
    assert 9 - _restored(base)["step"] <= 2, "at most memory_every_steps steps lost"
    _same(reference[8], _restored(base)["state"], "restored from memory")
    _same(reference["final"], torch.load(base / "out0" / "final.pt")["state"], "resumed from memory, at the end")

    _reset(base, backup)
    shutil.rmtree(base / "mem1")  # node 1 replaced: a new machine, empty memory
    _run(base)
    assert (_restored(base)["step"], _restored(base)["tier"]) == (8, "memory"), _logs(base)
    moved = [line for line in _logs(base).splitlines() if "from the memory tier" in line]
    assert moved and "(0.0 MB moved" not in moved[0], "the new node got its ranks' shards from their replicas"
    _same(reference["final"], torch.load(base / "out0" / "final.pt")["state"], "a replaced node, at the end")

    _reset(base, backup)
    _run(base, ranks=(2, 1))  # 3 ranks: the snapshot of 4 is resharded
    assert (_restored(base)["step"], _restored(base)["tier"]) == (8, "memory"), _logs(base)
    _same(reference[8], _restored(base)["state"], "restored from memory on 3 ranks")
    # the same job moved to 3 ranks at step 8 without a failure (a durable checkpoint of step 8, then 3 ranks)
    moved = tmp_path / "moved"
    moved.mkdir()
    _run(moved, every=("--steps", "8", "--persist-every", "8"))
    _run(moved, ranks=(2, 1))
    assert (_restored(moved)["step"], _restored(moved)["tier"]) == (8, "durable")
    _same(torch.load(moved / "out0" / "final.pt")["state"], torch.load(base / "out0" / "final.pt")["state"],
          "on 3 ranks from step 8: from the memory tier, and from a durable checkpoint of an unbroken run")

    _reset(base, backup)  # both copies of a shard lost: node 1 replaced, and node 0's replica of rank 2's gone
    shutil.rmtree(base / "mem1")
    next((base / "mem0").glob("run-*/epoch_1_step_8/model/shard-00003-*.safetensors")).unlink()
    _run(base)
    assert (_restored(base)["step"], _restored(base)["tier"]) == (6, "durable")
    assert "incomplete: 1 of its" in _logs(base)
    _same(reference["final"], torch.load(base / "out0" / "final.pt")["state"], "resumed from the durable tier")


@pytest.mark.slow
def test_a_snapshot_killed_mid_replication_is_never_used(tmp_path, reference):
    base = tmp_path / "job"
    base.mkdir()
    _lose_node1(base, "--die-at-point", "memory.replicating:4")  # the snapshot of step 10 (2, 4, 8, 10), files sent half-way
    assert list((base / "mem1").glob("run-*/.tmp-epoch_1_step_10-*")), "node 1 died while writing step 10"
    assert not list(base.glob("mem*/run-*/epoch_1_step_10")), "and no node committed it"
    _run(base)
    assert (_restored(base)["step"], _restored(base)["tier"]) == (8, "memory"), _logs(base)
    _same(reference["final"], torch.load(base / "out0" / "final.pt")["state"], "resumed after a torn snapshot")
    assert not any((base / "mem0").iterdir())


@pytest.mark.slow
def test_a_torchrun_restart_resumes_from_memory(tmp_path):
    ref, base = tmp_path / "ref", tmp_path / "job"
    ref.mkdir()
    base.mkdir()
    _run(ref, ranks=(2,))
    _run(base, ranks=(2,), every=("--die-at", "9", "--once-marker", str(base / "died")), restarts=1)
    assert (base / "died").exists() and "Restored step 8 from the memory tier" in _logs(base)
    assert _restored(base)["step"] == 8 and _restored(base)["tier"] == "memory", _logs(base)
    _same(torch.load(ref / "out0" / "final.pt")["state"], torch.load(base / "out0" / "final.pt")["state"],
          "after torchrun's restart")


def test_a_node_without_room_for_a_snapshot_beside_the_kept_one_is_named():
    from ckptio.tier.memory import no_room

    nodes = Nodes(["a", "a", "b", "b"])
    mb = 1_000_000
    facts = [(100 * mb, 1000 * mb)] * 2 + [(100 * mb, 350 * mb)] * 2  # node b keeps its 200 MB and a's 200 MB
    assert no_room(nodes, facts, Path("/dev/shm/x")) == ("the node of rank 2 needs 400.0 MB for it and has 350.0 MB "
                                                          "free in /dev/shm/x")
    assert no_room(nodes, [(100, 1000)] * 2 + [(100, 400)] * 2, Path("/x")) is None
    assert no_room(Nodes(["a", "a"]), [(100, 250), (100, 250)], Path("/x")) is None  # one node: no replicas


def test_a_link_planted_in_a_snapshot_is_never_followed(tmp_path, memory, caplog):
    from toy import Run

    run = Run(tmp_path / "ckpt", max_steps=20, memory_every_steps=2, persist_every_steps=5)
    _train(run, 8)
    run.mgr.close(free_memory=False)
    shard = next((next(memory.iterdir()) / "epoch_0_step_8" / "model").glob("shard-*.safetensors"))
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)  # the same bytes, but outside the snapshot: not a file the snapshot holds
    caplog.clear()
    info = Run(tmp_path / "ckpt", max_steps=20, memory_every_steps=2, persist_every_steps=5).mgr.restore()
    assert (info.step, info.tier) == (5, "durable")
    assert any("incomplete: 1 of its" in r.message for r in caplog.records)


def _needs_on_two_ranks(ckpt: str, memory: str) -> list[str]:
    import torch.distributed as dist
    from toy import Run

    from ckptio.engine.manifest import read_manifest
    from ckptio.storage.confined import Folder
    from ckptio.tier.needs import shard_files

    os.environ["CKPTIO_MEMORY_DIR"] = memory
    run = Run(ckpt, max_steps=20, memory_every_steps=2, io_threads=1)
    _train(run, 2)
    run.mgr.wait()
    snapshot = Folder(next(Path(memory).iterdir()) / "epoch_0_step_2")
    needs = sorted(shard_files(snapshot, read_manifest(snapshot), run.mgr.tracked))
    run.mgr.close(free_memory=False)
    dist.barrier()
    return needs


@pytest.mark.slow
def test_a_rank_needs_its_own_shards_and_the_small_file_of_whole_tensors(tmp_path):
    from distributed import run_ranks

    needs = run_ranks(2, _needs_on_two_ranks, ckpt=str(tmp_path / "ckpt"), memory=str(tmp_path / "shm"))
    whole = "optim/shard-00001-optim-00002-of-00002.safetensors"  # rank 0's: the step counters every rank reads
    assert needs[0] == ["model/shard-00001-model-00001-of-00001.safetensors",
                        "optim/shard-00001-optim-00001-of-00002.safetensors", whole]
    assert needs[1] == ["model/shard-00002-model-00001-of-00001.safetensors", whole,
                        "optim/shard-00002-optim-00001-of-00001.safetensors"]
    snapshot = next((tmp_path / "shm").iterdir()) / "epoch_0_step_2" / "optim"
    assert (snapshot / whole.split("/")[1]).stat().st_size < (snapshot / "shard-00002-optim-00001-of-00001.safetensors"
                                                              ).stat().st_size / 4


# many requests: on Azurite (a Node server, ~15 ms a request) 10-15 s, marked slow there
@pytest.mark.parametrize("store", ["s3", "gs", pytest.param("az", marks=pytest.mark.slow)], indirect=True)
def test_with_the_durable_tier_in_a_bucket(store, tmp_path, memory):
    """The memory tier over a durable tier in a bucket (S3 and GCS: ``store``): the snapshot newer than the bucket's
    checkpoint is restored from memory, a durable save newer than every snapshot from the bucket."""
    from toy import Run, full_state

    url = store.url("run")
    run = Run(url, max_steps=20, memory_every_steps=2, persist_every_steps=5)
    _train(run, 8)
    expected = full_state(run.model, run.opt)
    run.mgr.close(free_memory=False)
    info = Run(url, max_steps=20, memory_every_steps=2, persist_every_steps=5).mgr.restore()
    assert (info.step, info.tier) == (8, "memory")
    again = Run(url, max_steps=20, memory_every_steps=2, persist_every_steps=5)
    again.mgr.restore()
    _same(expected, full_state(again.model, again.opt), "restored from memory, durable tier in a bucket")
    _train(again, 10)  # a durable save of step 10 in the bucket: newer than every snapshot
    again.mgr.close(free_memory=False)
    info = Run(url, max_steps=20, memory_every_steps=2, persist_every_steps=5).mgr.restore()
    assert (info.step, info.tier) == (10, "durable")
