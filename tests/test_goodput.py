"""Issue 49, first step: the run's record (``goodput/record.py``) and the ``"auto"`` checkpoint interval
(``goodput/interval.py``), in real runs of the manager, real processes killed with SIGKILL, and 2 gloo ranks."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.goodput.interval import IntervalPlanner, daly_interval, parse_duration, young_interval
from ckptio.goodput.record import RECORD_NAME, RunRecord, parse
from ckptio.step_scheduler import StepScheduler
from ckptio.storage import open_storage

sys.path.insert(0, str(Path(__file__).parent))
from distributed import run_ranks  # noqa: E402
from forked_scripts import run_script, start  # noqa: E402


def _events(root: Path) -> list[dict]:
    return json.loads((root / RECORD_NAME).read_bytes())["events"]


def test_the_interval_is_the_formula_within_one_step_and_inside_the_users_bounds():
    assert young_interval(2.0, 3600) == pytest.approx(120.0)
    assert daly_interval(2.0, 3600) == pytest.approx(120.0 * (1 + (1 / 60) / 3 + (1 / 3600) / 9) - 2.0)
    assert daly_interval(50, 10) == 10  # a save costlier than twice the MTBF: one interval per failure
    for cost, step_s, mtbf in [(0.05, 0.1, 600), (2.0, 0.8, 6 * 3600), (60, 5.0, 7 * 86400), (0.3, 0.02, 3600)]:
        planner = IntervalPlanner("durable", mtbf_s=mtbf, learned_mtbf_s=None)
        planner.step_times.extend([step_s] * 5)
        planner.costs.extend([cost] * 3)
        expect = daly_interval(cost, mtbf) / step_s
        assert abs(planner.choice() - expect) <= 1, (cost, step_s, mtbf)
        assert "one failure per" in planner.reason and "(given)" in planner.reason
    bounded = IntervalPlanner("memory", mtbf_s=7 * 86400, learned_mtbf_s=None, min_steps=3, max_steps=40)
    bounded.step_times.append(0.1)
    bounded.costs.append(10.0)
    assert bounded.choice() == 40  # never less often than the user's maximum
    bounded.costs[0] = 1e-9
    assert bounded.choice() == 3
    assert parse_duration("6h", "mtbf") == 21600 and parse_duration(90, "mtbf") == 90
    for bad in ("6 hours", "-1h", 0, True, "inf"):
        with pytest.raises(Exception, match="mtbf"):
            parse_duration(bad, "mtbf")


def _train(root: Path, steps: int, **config: object) -> tuple[CheckpointManager, list[int]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), **config), model=model, optimizer=opt)
    info = mgr.restore()
    saved = []
    for step in range((info.step if info else 0) + 1, steps + 1):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
        if mgr.maybe_save(step=step) is not None:
            saved.append(step)
    return mgr, saved


def test_a_run_with_auto_saves_at_its_users_maximum_and_records_every_save(tmp_path):
    mgr, saved = _train(tmp_path, 23, persist_every_steps="auto", mtbf="30d", auto_max_steps=5)
    assert mgr._goodput.planners["durable"].every == 5
    assert saved == [5, 10, 15, 20]  # the first choice at the third step, then every 5 (a save costs ~ms here)
    mgr.close()
    events = _events(tmp_path)
    assert [e["kind"] for e in events if e["kind"] != "progress"] == ["start"] + ["save"] * 4 + ["end"]
    for e, step in zip([e for e in events if e["kind"] == "save"], saved):
        assert e["step"] == step and e["tier"] == "durable" and e["storage"] == "local" and e["ranks"] == 1
        assert e["bytes"] > 16 * 16 * 4 * 3 and e["files"] >= 3 and 0 < e["blocked_s"] <= e["total_s"] + 1e-3
    # a restart: resumed from 20, the record says so and how many steps were lost (none: 23 was not recorded
    # as reached, progress being written every 30 s)
    mgr, saved = _train(tmp_path, 30, persist_every_steps="auto", mtbf="30d", auto_min_steps=4, auto_max_steps=4)
    mgr.close()
    restore = next(e for e in _events(tmp_path) if e["kind"] == "restore")
    assert restore["step"] == 20 and restore["tier"] == "durable" and restore["restore_s"] > 0
    assert restore["startup_s"] > 0 and restore["steps_lost"] >= 0
    assert saved == [24, 28]  # counted from the step it resumed from


_FAILING_RUN = """
import os, signal, sys, time, torch
from ckptio import CheckpointConfig, CheckpointManager
model = torch.nn.Linear(8, 8)
mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=sys.argv[1], persist_every_steps="auto", auto_max_steps=50),
                        model=model)
info = mgr.restore()
for step in range(1, 6):
    time.sleep(0.05)
    mgr.maybe_save(step=step)
print("INTERVAL", mgr._goodput.planners["durable"].reason, flush=True)
if sys.argv[2] == "fail":
    mgr.save(step=5)
    os.kill(os.getpid(), signal.SIGKILL)  # a failure: no end is recorded
mgr.close()
"""


def test_the_mtbf_is_learned_from_the_runs_restarts(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_FAILING_RUN)
    root = tmp_path / "ckpt"
    first = run_script(str(script), str(root), "ok", timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "assumed: set mtbf=" in first.stdout
    for _ in range(3):
        out = run_script(str(script), str(root), "fail", timeout=300)
        assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    record = RunRecord(open_storage(root), writer=False, log=logging.getLogger("test"))
    assert record.failures()[0] == 2  # the third kill is known as one when the next process starts
    last = run_script(str(script), str(root), "ok", timeout=300)
    assert last.returncode == 0, last.stderr[-2000:]
    record = RunRecord(open_storage(root), writer=False, log=logging.getLogger("test"))
    failures, up = record.failures()
    assert failures == 3 and up > 0
    mtbf = record.learned_mtbf()
    assert mtbf == pytest.approx(up / 3)
    assert "learned: 3 failures in" in last.stdout and "observed" in last.stdout, last.stdout


_WRITER = """
import logging, sys
from ckptio.goodput.record import RunRecord
from ckptio.storage import open_storage
record = RunRecord(open_storage(sys.argv[1]), writer=True, log=logging.getLogger("w"))
print("READY", len(record.events), flush=True)
record.begin()
i = 0
while True:
    i += 1
    record.add("save", step=i, tier="durable", blocked_s=0.5, total_s=1.0, bytes=1 << 30, files=8, storage="local")
"""


def test_the_record_survives_kills_mid_write(tmp_path):
    """SIGKILL at random moments of a process that writes the record without pause: it always reads back whole,
    never shorter than before, and no leftover piles up (each restart's record is the last one written)."""
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    root = tmp_path / "ckpt"
    root.mkdir()
    rng = random.Random(49)
    count = 0
    for trial in range(20):
        job = start(str(script), str(root))
        for line in job.lines(timeout=120):
            if line.startswith("READY"):
                assert int(line.split()[1]) >= count, (trial, line)
                break
        time.sleep(rng.uniform(0.0, 0.3))
        job.signal(signal.SIGKILL)
        job.wait(60)
        events = parse((root / RECORD_NAME).read_bytes(), root / RECORD_NAME)  # whole, or this raises
        assert len(events) >= count
        count = len(events)
    assert count > 20
    assert len([p for p in root.iterdir() if p.name.endswith(".tmp")]) <= 1  # each start sweeps the last kill's


@pytest.mark.parametrize("content", [
    b"not json", b"[" * 100_000, json.dumps({"format": "ckptio-record", "version": 1, "events": [
        {"kind": "save", "time": 1.0, "step": 10 ** 400}]}).encode(),
    json.dumps({"format": "ckptio-record", "version": 1, "events": [{"kind": "rm -rf", "time": 1.0}]}).encode(),
    json.dumps({"format": "ckptio-record", "version": 1, "events": [{"kind": "save", "time": -5}]}).encode(),
    json.dumps({"format": "ckptio-record", "version": 1, "events": [{"kind": "save", "time": 1.0,
                                                                    "blocked_s": 1e300}]}).encode(),
    "link", "folder", "huge"])
def test_a_hostile_record_is_refused_by_name_and_training_goes_on(tmp_path, caplog, content):
    root = tmp_path / "ckpt"
    root.mkdir()
    target = root / RECORD_NAME
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    if content == "link":
        os.symlink(secret, target)
    elif content == "folder":
        target.mkdir()
    elif content == "huge":
        with open(target, "wb") as fh:
            fh.truncate(1 << 33)  # sparse: too large to keep aside, so it must be left as it is
    else:
        target.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        mgr, saved = _train(root, 6, persist_every_steps=3)
        mgr.close()
    assert saved == [3, 6]
    assert f"The run's record {target} is refused" in caplog.text
    assert secret.read_text() == "outside"
    aside = [p for p in root.iterdir() if p.name.startswith(RECORD_NAME + ".damaged-")]
    if content in ("folder", "huge"):
        assert not aside and "kept in memory only" in caplog.text
        assert target.is_dir() if content == "folder" else target.stat().st_size == 1 << 33
    else:
        if content != "link":
            assert aside[0].read_bytes() == content  # nothing lost
        assert [e["kind"] for e in _events(root) if e["kind"] != "progress"] == ["start", "save", "save", "end"]


def _auto_ranks(root: str) -> list[int]:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = torch.nn.Linear(8, 8)
    steps = StepScheduler(max_steps=30, ckpt_every_steps="auto")
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=root, mtbf="2s", auto_max_steps=7), model=model,
                            step_scheduler=steps)
    saved = []
    while not steps.done:
        time.sleep(0.01 if rank == 0 else 0.03)  # the ranks measure different step times: rank 0's choice counts
        steps.step += 1
        if steps.is_ckpt_step():
            mgr.save()
            saved.append(steps.step)
    mgr.close()
    return saved


def test_two_ranks_with_an_auto_step_scheduler_save_at_the_same_steps(tmp_path):
    first, second = run_ranks(2, _auto_ranks, root=str(tmp_path))
    assert first == second and len(first) >= 4, (first, second)
    events = _events(tmp_path)
    assert [e["step"] for e in events if e["kind"] == "save"] == first
    assert {e["ranks"] for e in events if e["kind"] in ("start", "save")} == {2}


def test_the_record_costs_little_next_to_a_save(tmp_path):
    """A record of 4,096 events (the most it keeps) is rewritten in a few milliseconds (measured properly in
    benchmarks/checkpoint_interval.py --record); here only that it stays bounded in size."""
    record = RunRecord(open_storage(tmp_path), writer=False, log=logging.getLogger("t"))
    for i in range(5000):
        record.add("save", step=i, tier="durable", blocked_s=0.1)
    record.writer = True
    record.begin()
    record.add("end")
    assert len(parse((tmp_path / RECORD_NAME).read_bytes(), "r")) == 4096
    assert (tmp_path / RECORD_NAME).stat().st_size < 1 << 20



def test_a_reader_reads_the_record_when_first_asked_and_adds_its_own_events_after_it(tmp_path):
    """Another rank's record is read when its events are first needed, not when made (a save or restore on N ranks
    asks the store for it once): what it holds then is the record's events followed by those it added meanwhile."""
    from ckptio.goodput.record import dump

    (tmp_path / RECORD_NAME).write_bytes(dump([{"kind": "start", "time": 1.0}, {"kind": "save", "time": 2.0,
                                                                                  "step": 7, "tier": "durable"}]))
    record = RunRecord(open_storage(tmp_path), writer=False, log=logging.getLogger("t"))
    record.add("start")
    (tmp_path / RECORD_NAME).write_bytes(dump([{"kind": "start", "time": 1.0}, {"kind": "save", "time": 2.0,
                                                                                  "step": 9, "tier": "durable"}]))
    assert record.newest_step() == 9  # read now, not when made
    assert [e["kind"] for e in record.events] == ["start", "save", "start"]
    record.add("progress", step=12)
    assert record.newest_step() == 12 and not (tmp_path / f"{RECORD_NAME}.tmp").exists()


def test_a_listener_gets_every_event_with_its_numbers(tmp_path):
    """The hook for loops other than the frameworks': what a tracker would log under ``ckpt/``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    seen: list[dict] = []
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), async_save=True), model=model)
    mgr.add_listener(seen.append)
    mgr.add_listener(lambda event: 1 / 0)  # a broken logger: said, never stops a save
    for step in (1, 2):
        mgr.save(step=step)
    mgr.close()
    saves = [e for e in seen if e["kind"] == "save"]
    assert [e["step"] for e in saves] == [1, 2] and seen[-1]["kind"] == "end"
    assert all(e["blocked_s"] <= e["total_s"] and e["bytes"] > 0 for e in saves)


def test_both_tiers_are_chosen_together_at_the_minimum_of_their_joint_loss():
    from ckptio.goodput.interval import plan_two_tiers, two_tier_interval, two_tier_loss

    for c_mem, c_dur, mtbf, share in [(0.05, 2.0, 6 * 3600, 0.9), (0.2, 30.0, 3600, 0.5), (0.01, 0.5, 600, 0.99),
                                      (1.0, 60.0, 7 * 86400, 0.8), (0.3, 3.0, 4 * 3600, 0.0)]:
        t, ratio = two_tier_interval(c_mem, c_dur, mtbf, share)
        best = two_tier_loss(t, ratio, c_mem, c_dur, mtbf, share)
        # a brute sweep of both intervals finds nothing better
        swept = min(two_tier_loss(t * f, k, c_mem, c_dur, mtbf, share)
                    for k in range(1, 400) for f in (0.25, 0.5, 0.7, 0.85, 0.95, 1.0, 1.05, 1.2, 1.5, 2, 4))
        assert best <= swept * 1.0001, (c_mem, c_dur, mtbf, share)
        if share == 0:  # the memory tier saves nothing: Young's interval of the durable tier, every save durable
            assert ratio == 1 and t == pytest.approx(young_interval(c_dur, mtbf))
    memory = IntervalPlanner("memory", mtbf_s=6 * 3600, learned_mtbf_s=None, max_steps=None)
    durable = IntervalPlanner("durable", mtbf_s=6 * 3600, learned_mtbf_s=None, max_steps=5000)
    for planner, cost in ((memory, 0.05), (durable, 2.0)):
        planner.step_times.extend([0.5] * 5)
        planner.costs.extend([cost] * 3)
    mem, dur = plan_two_tiers(memory, durable, 0.9, "given")
    t, ratio = two_tier_interval(0.05, 2.0, 6 * 3600, 0.9)
    assert abs(mem - t / 0.5) <= 1 and dur == mem * ratio and ratio > 1
    assert "recovers from 90% of them (given)" in memory.reason and f"every {ratio} memory" in durable.reason
    durable.max_steps = mem * ratio - 1  # the user's maximum still wins
    assert plan_two_tiers(memory, durable, 0.9, "given")[1] == mem * ratio - 1
    durable.max_steps = mem - 3  # below the memory interval: the snapshots are as often
    assert plan_two_tiers(memory, durable, 0.9, "given") == (mem - 3, mem - 3)


def test_the_memory_tiers_share_of_recoveries_is_learned_from_restores_after_failures(tmp_path):
    from ckptio.goodput import _memory_share
    from ckptio.goodput.record import dump

    def record(events: list[dict]) -> RunRecord:
        (tmp_path / RECORD_NAME).write_bytes(dump(events))
        return RunRecord(open_storage(tmp_path), writer=False, log=logging.getLogger("test"))

    t = iter(range(1000))
    start = lambda: {"kind": "start", "time": float(next(t))}  # noqa: E731
    restore = lambda tier: {"kind": "restore", "time": float(next(t)), "step": 5, "tier": tier}  # noqa: E731
    end = lambda: {"kind": "end", "time": float(next(t))}  # noqa: E731
    # a clean restart's restore does not count; three after failures: two from memory, one durable
    events = [start(), end(), start(), restore("durable"), start(), restore("memory"), start(), restore("memory"),
              start(), restore("durable"), end()]
    rec = record(events)
    assert rec.recoveries() == (2, 3)
    share, source = _memory_share(None, rec)
    assert share == pytest.approx((2 + 2 * 0.9) / 5) and "learned from 3 restore(s)" in source
    assert _memory_share(0.5, rec) == (0.5, "given")
    assert _memory_share(None, record([start()]))[1].startswith("assumed")


def test_a_run_with_both_tiers_auto_saves_durably_on_a_multiple_of_the_memory_interval(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ckptio"):
        mgr, saved = _train(tmp_path, 80, persist_every_steps="auto", memory_every_steps="auto", mtbf="5s",
                            memory_recovers=0.99, auto_min_steps=2)
    mem, dur = mgr._goodput.planners["memory"], mgr._goodput.planners["durable"]
    assert mem.every is not None and dur.every is not None and dur.every % mem.every == 0
    assert "recovers from 99% of them (given)" in caplog.text and "Checkpoint interval (durable, auto)" in caplog.text
    kinds = [e.get("tier") for e in mgr._goodput.record.events if e["kind"] == "save"]
    assert "memory" in kinds and "durable" in kinds
    mgr.close()


def test_memory_snapshots_write_the_record_once_per_half_minute_and_lose_no_event(tmp_path):
    """A snapshot's event is made on the training thread: after the first, the record is written with the next
    durable save (or the end, or 30 s later), not at each snapshot; every event is in it in the end."""
    from ckptio.goodput.record import RunRecord as Record

    writes = []
    real = Record._write

    def counted(self):
        writes.append([e.get("tier") for e in self.events if e["kind"] == "save"])
        real(self)

    Record._write = counted
    try:
        mgr, saved = _train(tmp_path, 12, memory_every_steps=1, persist_every_steps=6)
        mgr.close()
    finally:
        Record._write = real
    tiers = [e.get("tier") for e in _events(tmp_path) if e["kind"] == "save"]
    assert tiers.count("memory") == 10 and tiers.count("durable") == 2  # steps 6 and 12 are durable
    assert 3 <= len(writes) <= 5, writes  # the first snapshot, each durable save, the end: not one per snapshot
