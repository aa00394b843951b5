"""No record and no number makes the "auto" interval, the config or the report fail (issue 67, rows 13-16)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptio import CheckpointConfig
from ckptio.errors import ConfigError
from ckptio.goodput.interval import MAX_STEPS, IntervalPlanner, plan_two_tiers, steps_for
from ckptio.goodput.record import RECORD_NAME, RunRecord, dump
from ckptio.storage import open_storage


def _record(tmp_path, events: list[dict]) -> RunRecord:
    (tmp_path / RECORD_NAME).write_bytes(dump(events))
    return RunRecord(open_storage(tmp_path), writer=False, log=logging.getLogger("test"))


def test_the_learned_mtbf_weighs_uptime_without_failures_and_ignores_events_from_the_future(tmp_path):
    now = time.time() - 100
    crash = [{"kind": "start", "time": now}, {"kind": "progress", "time": now + 0.18, "step": 1}]
    healthy = [{"kind": "start", "time": now + 1}, {"kind": "progress", "time": now + 2.08, "step": 9},
               {"kind": "end", "time": now + 2.08}]
    rec = _record(tmp_path, crash + healthy)
    assert rec.learned_mtbf() == pytest.approx(0.18 + 1.08)  # the healthy process's uptime counts
    forged = crash + [{"kind": "start", "time": now + 1}, {"kind": "progress", "time": now + 1e7, "step": 9}]
    assert _record(tmp_path, forged).learned_mtbf() == pytest.approx(0.18)  # a future event was never seen
    planner = IntervalPlanner("durable", mtbf_s=None, learned_mtbf_s=0.18, learned_failures=1)
    first, source = planner.mtbf_s
    assert "one failure: a rough estimate" in source
    planner._born -= 3600  # this process has now run an hour without failing: it weighs in
    assert planner.mtbf_s[0] > first + 3000


def test_degenerate_records_fall_back_to_the_defaults_and_never_stop_training(tmp_path):
    same = [{"kind": "start", "time": 10.0}, {"kind": "start", "time": 10.0}]
    assert _record(tmp_path, same).learned_mtbf() is None  # two starts at one instant: no rate at all
    memory = IntervalPlanner("memory", mtbf_s=None, learned_mtbf_s=0.0, first_cost_s=0.05)
    durable = IntervalPlanner("durable", mtbf_s=None, learned_mtbf_s=0.0, first_cost_s=2.0)
    for planner in (memory, durable):
        planner.costs.extend([0.0] * 20)  # saves that blocked 0 s
        planner.step_times.extend([0.5] * 5)
        assert planner.cost()[0] > 0 and planner.mtbf_s[0] > 0
        assert 1 <= planner.choice() <= MAX_STEPS
    mem, dur = plan_two_tiers(memory, durable, 0.9, "given")
    assert 1 <= mem <= dur <= MAX_STEPS


@pytest.mark.parametrize("value", [1e19, 1.7976931348623157e308, "10000000000000000000h",
                                   "1" + "0" * 308 + "h", float("inf")])
def test_an_mtbf_too_large_is_a_config_error_naming_the_field(tmp_path, value):
    with pytest.raises(ConfigError, match="mtbf"):
        CheckpointConfig(checkpoint_dir=str(tmp_path), mtbf=value)


def test_steps_for_is_bounded_whatever_the_numbers():
    assert steps_for(60.0, 5e-324) == MAX_STEPS
    assert steps_for(float("inf"), 1.0) == MAX_STEPS
    assert steps_for(0.0, 1.0) == 1 and steps_for(60.0, 0.0) == MAX_STEPS and steps_for(float("nan"), 1.0) == 1


def test_the_report_renders_a_record_whose_step_time_is_subnormal(tmp_path):
    events = [{"kind": "start", "time": 0.0},
              {"kind": "save", "time": 0.0, "step": 0, "tier": "durable", "blocked_s": 0.5, "total_s": 1.0,
               "bytes": 4096, "files": 2},
              {"kind": "progress", "time": 5e-324, "step": 1}]
    (tmp_path / RECORD_NAME).write_bytes(dump(events))
    cli = [str(Path(sys.executable).parent / "ckptio"), "report", str(tmp_path), "--probe-mib", "0"]
    for extra in ([], ["--json"], ["--html", str(tmp_path / "page.html")]):
        out = subprocess.run(cli + extra, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (extra, out.stderr[-2000:])
        assert "Traceback" not in out.stderr
        if extra == ["--json"]:
            json.loads(out.stdout)
    assert (tmp_path / "page.html").stat().st_size > 1000
