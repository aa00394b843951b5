"""The memory tier's copies: ``memory_replicas`` nodes per part, placed over failure domains (issue 39).

The placement is a pure function (``ckptio.tier.placement.place``): its properties are checked over every small
combination of nodes, domains and K (against an exhaustive search for the least possible largest load) and over
random larger ones. The jobs run three ``torchrun`` "nodes" of one rank on 127.0.0.1, each with its own memory
folder and ``CKPTIO_FAILURE_DOMAIN``; every node dies after step 9 (the snapshot of step 8 committed, the
durable checkpoint of step 6), and a lost node is one whose memory folder is gone (replaced by an empty one).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from distributed import free_port, wait_or_kill  # noqa: E402

from ckptio import CheckpointConfig, ConfigError  # noqa: E402
from ckptio.errors import CheckpointCorruptError  # noqa: E402
from ckptio.storage.confined import Folder  # noqa: E402
from ckptio.tier.choice import Nodes, candidates, copies, no_room  # noqa: E402
from ckptio.tier.node import Held, tier_record  # noqa: E402
from ckptio.tier.placement import place  # noqa: E402

WORKER = Path(__file__).with_name("memory_node_worker.py")
COMMON = ("--steps", "12", "--memory-every", "2", "--persist-every", "6")


# ------------------------------------------------------------------------------------------------- placement
def _labelings(n: int):
    """Every way to put ``n`` nodes into domains (up to the domains' names)."""
    def grow(seq: list[int], used: int):
        if len(seq) == n:
            yield [f"d{x}" for x in seq]
            return
        for d in range(used + 1):
            yield from grow([*seq, d], max(used, d + 1))
    yield from grow([], 0)


def _least_largest_load(domains: list[str], k: int) -> int:
    """By exhaustive search: the least largest count of copies of other nodes' parts that any placement keeping
    the domain spread achieves."""
    n = len(domains)
    c, spread = min(k, n), min(k, n, len(set(domains)))
    options = [[s for s in itertools.combinations([j for j in range(n) if j != i], c - 1)
                if len({domains[i], *(domains[j] for j in s)}) >= spread] for i in range(n)]
    best = n
    for combo in itertools.product(*options):
        load = [0] * n
        for s in combo:
            for j in s:
                load[j] += 1
        best = min(best, max(load))
    return best


def _check(domains: list[str], k: int) -> None:
    p = place(domains, k)
    n, where = len(domains), f"domains {domains}, K={k}"
    assert p.copies == min(k, n) and p.spread == min(k, n, len(set(domains))), where
    for i, held in enumerate(p.holders):
        assert held[0] == i and len(held) == p.copies == len(set(held)), f"{where}: node {i}: {held}"
        assert len({domains[j] for j in held}) == p.spread, f"{where}: node {i}'s copies span too few domains"
    assert sum(p.load()) == n * (p.copies - 1)
    assert place(list(domains), k) == p, f"{where}: not deterministic"
    renamed = {d: f"other-{d[::-1]}" for d in set(domains)}
    assert place([renamed[d] for d in domains], k).holders == p.holders, f"{where}: depends on the domains' names"
    assert (p.shortfall is None) == (p.spread == k or n == 1), where


def test_every_small_placement_has_distinct_holders_the_widest_spread_and_the_least_largest_load():
    cases = 0
    for n in range(1, 7):
        for domains in _labelings(n):
            for k in range(1, 5):
                _check(domains, k)
                if n <= 5 or k <= 2:  # the search is exhaustive: kept small
                    assert max(place(domains, k).load()) == _least_largest_load(domains, k), (domains, k)
                cases += 1
    assert cases > 800


def test_larger_placements_keep_the_properties_and_balance_when_the_domains_allow():
    rng = random.Random(39)
    for _ in range(60):
        n, d, k = rng.randint(2, 40), rng.randint(1, 8), rng.randint(1, 5)
        domains = [f"rack{rng.randrange(d)}" for _ in range(n)]
        _check(domains, k)
        sizes = [domains.count(x) for x in set(domains)]
        if len(set(sizes)) == 1 and len(sizes) >= min(k, n):  # even domains, enough of them: every node the same
            assert len(set(place(domains, k).load())) == 1, (domains, k, place(domains, k))
    for n in (4, 16, 64):
        for k in (1, 2, 3):
            assert place([str(i) for i in range(n)], k).load() == [k - 1] * n, "one node per domain: K-1 copies each"
    cluster = [f"rack{i // 16}" for i in range(1024)]  # 1,024 nodes in 64 racks of 16
    _check(cluster, 3)
    assert place(cluster, 3).load() == [2] * 1024


def test_with_each_node_its_own_domain_and_two_copies_a_part_goes_to_the_next_node():
    assert place(["a", "b", "c", "d"], 2).holders == ((0, 1), (1, 2), (2, 3), (3, 0))
    assert place(["a", "b", "c"], 1).holders == ((0,), (1,), (2,))
    nodes = Nodes(["n0", "n0", "n1", "n1"])  # no domains given: each node its own, K=2 (the defaults)
    assert [nodes.holders(r) for r in range(4)] == [[2], [3], [0], [1]]


def test_copies_leave_a_rack_that_holds_two_nodes():
    p = place(["rack-a", "rack-a", "rack-b"], 2)
    assert p.holders == ((0, 2), (1, 2), (2, 0)), "both parts of rack a are also on rack b's node"
    assert p.load() == [1, 0, 2] and p.shortfall is None
    big = place(["a", "a", "a", "a", "b"], 2)
    assert big.load()[4] == 4, "the domain spread comes first: rack b's one node holds a copy of every part of a"
    assert max(big.load()[:4]) == 1


def test_fewer_domains_or_nodes_than_copies_is_said():
    p = place(["a", "a", "b"], 3)
    assert p.spread == 2 and p.copies == 3 and "span 2 failure domain(s)" in p.shortfall
    assert "has 2 node(s): each part is held on 2 node(s)" in place(["a", "b"], 3).shortfall
    assert place(["a"], 2).shortfall is None, "one node: nothing to replicate, no warning"


def test_each_rank_sends_to_the_same_local_rank_on_every_holder_node_and_the_record_goes_everywhere():
    nodes = Nodes(["x", "x", "y", "y", "z", "z"], ["r1", "r1", "r1", "r1", "r2", "r2"], replicas=3)
    assert [nodes.holders(r) for r in range(6)] == [[4, 2], [5, 3], [4, 0], [5, 1], [0, 2], [1, 3]]
    owners = [{f"f{r}": (10, "c")} | ({"memory_tier.json": (5, "t")} if r == 0 else {}) for r in range(6)]
    moves = copies(Nodes(["x", "y", "z"], replicas=1), [{"a": (1, "c"), "memory_tier.json": (5, "t")}, {}, {}],
                   "memory_tier.json")
    assert [(m.dst, m.rel) for m in moves] == [(1, "memory_tier.json"), (2, "memory_tier.json")]
    moves = copies(nodes, owners, "memory_tier.json")
    assert sorted((m.src, m.dst) for m in moves if m.rel == "memory_tier.json") == [(0, 2), (0, 4)]
    mb = 1_000_000
    rack = Nodes(["x", "x", "y", "y", "z", "z"], ["r1", "r1", "r1", "r1", "r2", "r2"])  # two copies
    # node z (ranks 4, 5), alone in its rack, keeps its own 2 parts and copies of the 4 others: 600 MB; x: 400 MB
    assert no_room(rack, [(100 * mb, 550 * mb)] * 6, Path("/x")) == ("the node of rank 4 needs 600.0 MB for it and "
                                                                    "has 550.0 MB free in /x")
    assert no_room(rack, [(100 * mb, 600 * mb)] * 6, Path("/x")) is None


def test_memory_replicas_is_a_positive_integer():
    assert CheckpointConfig().memory_replicas == 2
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(ConfigError, match="memory_replicas must be a positive integer"):
            CheckpointConfig(memory_replicas=bad)


# ------------------------------------------------------------------------------------------------- the record
def _record(tmp_path: Path, placement) -> Folder:
    folder = tmp_path / "snap"
    folder.mkdir(exist_ok=True)
    (folder / "memory_tier.json").write_text(json.dumps({"run": "r", "durable_step": 6, "placement": placement}))
    return Folder(folder)


def test_the_placement_a_snapshot_records_is_read_typed_and_bounded(tmp_path):
    nodes = Nodes(["x", "y", "z"], ["a", "a", "b"])
    assert tier_record(_record(tmp_path, nodes.record()))["placement"] == {
        "replicas": 2, "nodes": ["x", "y", "z"], "domains": ["a", "a", "b"], "holders": [[0, 2], [1, 2], [2, 0]]}
    for bad, said in (({**nodes.record(), "holders": [[0, 2], [1, 7], [2, 0]]}, "holders\\[1\\]"),
                      ({**nodes.record(), "replicas": 9}, "placement.replicas"),
                      ({**nodes.record(), "domains": ["a"]}, "3 nodes but 1 domains"),
                      ({**nodes.record(), "nodes": "xyz"}, "nodes"),
                      ([1, 2], "placement")):
        with pytest.raises(CheckpointCorruptError, match=said) as err:
            tier_record(_record(tmp_path, bad))
        assert "memory_tier.json" in str(err.value)


def test_an_incomplete_snapshot_says_how_its_parts_were_held():
    record = {"run": "r", "durable_step": None, "placement": {"replicas": 1, "nodes": ["x", "y"],
                                                              "domains": ["x", "y"], "holders": [[0], [1]]}}
    everyone = [{"s8": Held(8, "d", 2, ["a", "memory_tier.json"], record, {"total": 3, "manifest_size": 10})}]
    usable, message = candidates(everyone, "r", None)
    assert not usable and "1 of its 3 files are on no surviving node (memory_replicas=1: each part was on its own " \
                          "node only)" in message


# ------------------------------------------------------------------------------------------------- nodes
def _job(base: Path, node: int, port: int, domain: str | None, *args: str) -> subprocess.Popen:
    env = {**os.environ, "CKPTIO_MEMORY_DIR": str(base / f"mem{node}"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "CKPTIO_TOY_MODEL": "plain"}
    env.pop("CKPTIO_FAILURE_DOMAIN", None)
    if domain is not None:
        env["CKPTIO_FAILURE_DOMAIN"] = domain
    log = open(base / f"log{node}.txt", "a")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=3", f"--node-rank={node}",
                             "--master-addr=127.0.0.1", f"--master-port={port}", "--nproc-per-node=1",
                             "--max-restarts=0", str(WORKER), "--ckpt", str(base / "ckpt"), *COMMON,
                             "--out", str(base / f"out{node}"), *args], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def _logs(base: Path) -> str:
    return "\n".join(p.read_text()[-4000:] for p in sorted(base.glob("log*.txt")))


def _run(base: Path, domains: tuple[str | None, ...] = (None, None, None), *args: str, ok: bool = True) -> None:
    port = free_port()
    procs = [_job(base, i, port, d, *args) for i, d in enumerate(domains)]
    for proc in procs:
        code = wait_or_kill(proc, 300, lambda: _logs(base))
        assert (code == 0) == ok, f"job {'failed' if ok else 'was to die'}:\n{_logs(base)}"


def _same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys() and len([k for k in a if k.startswith("optim/")]) > 10, where
    for k in a:
        assert torch.equal(a[k], b[k]), f"{where}: {k} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted job on 3 nodes of one rank: the state at every save, and at the end."""
    base = tmp_path_factory.mktemp("reference")
    _run(base, (None, None, None), "--dump")
    return {8: torch.load(base / "out0" / "state_8.pt"), "final": torch.load(base / "out0" / "final.pt")["state"]}


def _died(tmp_path: Path, domains: tuple[str | None, ...], *args: str) -> tuple[Path, Path]:
    """Every node dies after step 9 (snapshot of step 8 committed, durable checkpoint of step 6); the folders as
    they were left are kept in ``backup``."""
    base, backup = tmp_path / "job", tmp_path / "backup"
    base.mkdir()
    _run(base, domains, "--die-at", "9", *args, ok=False)
    assert all(list((base / f"mem{i}").glob("run-*/epoch_*_step_8")) for i in range(3)), _logs(base)
    shutil.copytree(base, backup, symlinks=True)
    return base, backup


def _restart(base: Path, backup: Path, lost: tuple[int, ...], domains: tuple[str | None, ...], *args: str) -> dict:
    """The job restarted where it died (a run is known by its checkpoint folder's path) with the nodes ``lost``
    replaced by new ones (empty memory); what it restored."""
    for name in ("ckpt", "mem0", "mem1", "mem2", "out0", "out1", "out2"):
        shutil.rmtree(base / name, ignore_errors=True)
        if name not in {f"mem{i}" for i in lost} and (backup / name).exists():
            shutil.copytree(backup / name, base / name, symlinks=True)
    for log in base.glob("log*.txt"):
        log.unlink()
    _run(base, domains, *args)
    return torch.load(base / "out0" / "restored.pt")


def _shards(base: Path, node: int) -> list[str]:
    """The model's shard files node ``node`` holds of the snapshot of step 8 (``shard-0000<rank+1>-...``)."""
    return sorted({p.name[:11] for p in base.glob(f"mem{node}/run-*/epoch_*_step_8/model/shard-*.safetensors")})


@pytest.mark.slow
def test_a_rack_of_two_nodes_lost_and_replaced_resumes_from_memory_bitwise(tmp_path, reference):
    rack = ("rack-a", "rack-a", "rack-b")
    base, backup = _died(tmp_path, rack)
    assert _shards(backup, 2) == ["shard-00001", "shard-00002", "shard-00003"], "rack b's node holds rack a's parts"
    assert ("on 3 node(s) in 2 failure domain(s) (each rank's part on 2 nodes of 2 failure domain(s); copies of other "
            "nodes' parts per node: 0 to 2)") in (backup / "log0.txt").read_text()
    restored = _restart(base, backup, (0, 1), rack)
    assert (restored["step"], restored["tier"]) == (8, "memory"), _logs(base)
    assert "Restored step 8 from the memory tier" in _logs(base)
    _same(reference[8], restored["state"], "restored from memory, rack a lost")
    _same(reference["final"], torch.load(base / "out0" / "final.pt")["state"], "rack a lost, at the end")


@pytest.mark.slow
def test_three_copies_on_three_nodes_survive_any_two_nodes_lost(tmp_path, reference):
    base, backup = _died(tmp_path, (None, None, None), "--replicas", "3")
    assert all(_shards(backup, i) == ["shard-00001", "shard-00002", "shard-00003"] for i in range(3))
    for lost in ((0, 1), (0, 2), (1, 2)):
        restored = _restart(base, backup, lost, (None, None, None), "--replicas", "3")
        assert (restored["step"], restored["tier"]) == (8, "memory"), f"nodes {lost} lost:\n{_logs(base)}"
        _same(reference[8], restored["state"], f"restored from memory, nodes {lost} lost")
    _same(reference["final"], torch.load(base / "out0" / "final.pt")["state"], "nodes 1 and 2 lost, at the end")


@pytest.mark.slow
def test_one_copy_a_lost_node_falls_back_to_the_durable_tier_and_says_why(tmp_path, reference):
    base, backup = _died(tmp_path, (None, None, None), "--replicas", "1")
    assert [_shards(backup, i) for i in range(3)] == [["shard-00001"], ["shard-00002"], ["shard-00003"]]
    assert "memory_replicas=1: each rank's part on its own node only" in (backup / "log0.txt").read_text()
    restored = _restart(base, backup, (1,), (None, None, None), "--replicas", "1")
    assert (restored["step"], restored["tier"]) == (6, "durable"), _logs(base)
    assert "are on no surviving node (memory_replicas=1: each part was on its own node only)" in _logs(base)
    _same(reference["final"], torch.load(base / "out0" / "final.pt")["state"], "resumed from the durable tier")


# ------------------------------------------------------------------------------------------------- a damaged copy
def _damaged_own_copy(ckpt: str, memory: str) -> dict:
    import logging

    import torch.distributed as dist
    from toy import Run, full_state

    rank = dist.get_rank()
    os.environ["CKPTIO_MEMORY_DIR"] = f"{memory}{rank}"  # each rank a node of its own
    os.environ["CKPTIO_FAILURE_DOMAIN"] = "rack-a"  # both in one rack: said once, as a warning
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptio").addHandler(handler)
    run = Run(ckpt, max_steps=20, memory_every_steps=2, persist_every_steps=5)
    run.train(stop_at=8, after_step=run.mgr.maybe_save)
    run.mgr.wait()
    expected = full_state(run.model, run.opt)
    run.mgr.close(free_memory=False)
    first = list(said)
    damaged = ""
    if rank == 0:  # node 0's own copy of rank 0's model shard: a bit flipped
        shard = sorted(Path(f"{memory}0").glob("run-*/epoch_*_step_8/model/shard-00001-*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x10
        os.chmod(shard, 0o600)
        shard.write_bytes(bytes(data))
        damaged = shard.name
    dist.barrier()
    said.clear()
    again = Run(ckpt, max_steps=20, memory_every_steps=2, persist_every_steps=5)
    info = again.mgr.restore()
    now = full_state(again.model, again.opt)
    again.mgr.close()
    return {"step": info.step, "tier": info.tier, "said": said, "damaged": damaged, "first": first,
            "same": expected.keys() == now.keys() and all(torch.equal(expected[k], now[k]) for k in now)}


@pytest.mark.slow
def test_a_damaged_own_copy_is_taken_from_the_next_holder_and_one_rack_is_said_once(tmp_path):
    from distributed import run_ranks

    out = run_ranks(2, _damaged_own_copy, ckpt=str(tmp_path / "ckpt"), memory=str(tmp_path / "mem"))
    assert (out[0]["step"], out[0]["tier"]) == (8, "memory"), out[0]["said"]
    assert out[0]["same"] and out[1]["same"], "bitwise the state of step 8"
    assert any(out[0]["damaged"] in line and "this node's copy is damaged" in line and "trying another node" in line
               for line in out[0]["said"]), out[0]["said"]
    shortfall = [line for line in out[0]["first"] if "span 1 failure domain(s)" in line]
    assert len(shortfall) == 1, f"said once over 4 snapshots: {out[0]['first']}"
    assert not [line for line in out[1]["first"] if "failure domain" in line], "by rank 0 only"
