"""No record and no number makes the "auto" interval, the config or the report fail (issue 67, rows 13-16)."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest

from ckptio import CheckpointConfig
from ckptio.errors import ConfigError
from ckptio.goodput.interval import MAX_STEPS, IntervalPlanner, plan_two_tiers, steps_for
from ckptio.goodput.record import RECORD_NAME, RunRecord, dump
from ckptio.storage import open_storage
from cli_here import ckptio_here


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
    for extra in ([], ["--json"], ["--html", str(tmp_path / "page.html")]):
        out = ckptio_here("report", tmp_path, "--probe-mib", "0", *extra)
        assert out.returncode == 0, (extra, out.stderr[-2000:])
        assert "Traceback" not in out.stderr
        if extra == ["--json"]:
            json.loads(out.stdout)
    assert (tmp_path / "page.html").stat().st_size > 1000


# ---------------------------------------------------------------------------------------------- issue 67, round two
sys.path.insert(0, str(Path(__file__).parent))
from forked_scripts import run_script  # noqa: E402

_AUTO_RUN = """
import json, logging, sys, time, torch
from pathlib import Path
from ckptio import CheckpointConfig, CheckpointManager
from ckptio.goodput.record import RECORD_NAME, dump
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
root, events, tiers = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3].split(",")
now = time.time()
if not (root / RECORD_NAME).exists():  # times relative to now (the first launch writes it, the second reuses it)
    root.mkdir(parents=True, exist_ok=True)
    (root / RECORD_NAME).write_bytes(dump([dict(e, time=max(0.0, now + e["time"])) for e in events]))
model = torch.nn.Linear(8, 8)
mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), **{f"{t}_every_steps": "auto" for t in tiers}),
                        model=model)
born = time.monotonic()
saved = []
for step in range(1, 81):
    time.sleep(0.0135)
    if mgr.maybe_save(step=step) is not None:
        saved.append(step)
mtbf, source = mgr._goodput.planners["durable"].mtbf_s
# one write: print() writes its parts apart, and the memory tier's thread logs to the same stdout in between
sys.stdout.write("RESULT " + json.dumps({"saved": saved, "mtbf": mtbf, "source": source,
                                          "up": time.monotonic() - born}) + "\\n")
sys.stdout.flush()
mgr.close()
"""


def _auto_run(tmp_path, root: Path, events: list[dict], tiers: str = "persist") -> tuple[dict, str]:
    script = tmp_path / "auto_run.py"
    script.write_text(_AUTO_RUN)
    out = run_script(str(script), str(root), json.dumps(events), tiers, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), out.stdout


def test_the_learned_mtbf_ignores_events_after_now_and_before_the_records_start(tmp_path):
    """Row 13: the uptime an MTBF rests on lies between the record's first event and now: an event stamped after
    now (even within minutes) or before the record began is not counted, so no forged stamp stretches it."""
    now = time.time() - 100
    crash = [{"kind": "start", "time": now}, {"kind": "progress", "time": now + 0.18, "step": 1}]
    healthy = [{"kind": "start", "time": now + 1}, {"kind": "progress", "time": now + 2.08, "step": 9}]
    assert _record(tmp_path, crash + healthy).learned_mtbf() == pytest.approx(1.26)
    for forged in ([{"kind": "progress", "time": time.time() + 250, "step": 10}],  # after now, by minutes
                   [{"kind": "save", "time": time.time() + 1e6, "step": 10, "tier": "durable"}],
                   [{"kind": "start", "time": 5.0}, {"kind": "progress", "time": now + 2.5, "step": 10}],
                   [{"kind": "progress", "time": 0.0, "step": 10}]):  # before the record's start
        rec = _record(tmp_path, crash + healthy + forged)
        failures, up = rec.failures()
        assert up <= time.time() - now, forged  # never more running than the record can have seen
        assert rec.learned_mtbf() <= 2.6, forged


def test_one_early_crash_then_a_healthy_process_learns_from_both_and_says_its_basis(tmp_path):
    """Row 13, through a real run: a crash 0.18 s after its start (and a forged event minutes ahead), then a healthy
    process: the MTBF it plans with is the crash's 0.18 s plus its own running without failing (a censored estimate,
    the forged event not counted), and the log says what it rests on."""
    crash = [{"kind": "start", "time": -60.0}, {"kind": "progress", "time": -59.82, "step": 3},
             {"kind": "progress", "time": 250.0, "step": 4}]
    result, out = _auto_run(tmp_path, tmp_path / "ckpt", crash)
    assert 0.18 + 0.5 * result["up"] <= result["mtbf"] <= 0.18 + result["up"] + 1.0, result
    assert "1 failure in" in result["source"] and "observed" in result["source"], result
    assert "Mean time between failures learned from the run's record: 1 failure in" in out, out
    assert "a rough estimate" in out


@pytest.mark.parametrize("blocked, crash", [(0.0, 0.0), (5e-324, 0.0), (5e-324, 0.18)])
def test_a_record_of_costless_saves_and_instant_failures_never_stops_training(tmp_path, blocked, crash):
    """Row 14: 20 saves that blocked 0 s (or a denormal 5e-324 s) and two starts at one instant (a learned MTBF of
    0), or a crash 0.18 s after its start, pass the record's checks; both launches over such a record train to the
    end, both tiers automatic, the degenerate numbers replaced by the defaults and said so."""
    events = [{"kind": "start", "time": -60.0}]
    events += [{"kind": "save", "time": -60.0 + crash * i / 20, "step": i, "tier": "durable", "blocked_s": blocked}
               for i in range(1, 21)]
    events += [{"kind": "start", "time": -60.0 + crash}]
    root = tmp_path / "ckpt"
    for launch in range(2):
        result, out = _auto_run(tmp_path, root, events, "memory,persist")
        if launch == 0:  # (the second one's record holds the first one's saves, measured)
            assert "a durable save is estimated to block" in out, out  # a cost of 0 s is no measurement
        if not crash:
            assert "gives no usable failure rate" in out and "assumed: set mtbf=" in out, out
            assert len(result["saved"]) < 40, result  # not a save at every step


@pytest.mark.parametrize("value", ["1e19h", "1.7976931348623157e308h", "1e19", "1.7976931348623157e308",
                                   10**400, -(10**400)])
def test_an_mtbf_beyond_floats_is_a_config_error_naming_it(tmp_path, value):
    """Row 15: numbers written with an exponent are read as numbers (and refused beyond a century), an integer too
    large for a float is refused the same: never an OverflowError."""
    with pytest.raises(ConfigError, match=r"mtbf must be (at most a century|a positive duration)"):
        CheckpointConfig(checkpoint_dir=str(tmp_path), mtbf=value)


def test_an_mtbf_with_an_exponent_or_below_a_millisecond(tmp_path):
    assert CheckpointConfig(checkpoint_dir=str(tmp_path), mtbf="1.5e3s").mtbf == "1.5e3s"
    from ckptio.goodput.interval import parse_duration

    assert parse_duration("1.5e3s", "mtbf") == 1500.0 and parse_duration("2E1m", "mtbf") == 1200.0
    with pytest.raises(ConfigError, match="mtbf must be at least"):
        CheckpointConfig(checkpoint_dir=str(tmp_path), mtbf="1e-300")


@pytest.mark.parametrize("total", [0.0, 5e-324])
def test_the_report_renders_a_record_of_instant_saves_against_a_measured_storage(tmp_path, total):
    """Row 16: a save whose whole time is 0 (or 5e-324) s, next to the storage's measured write rate, and a step
    time of 5e-324 s: the three outputs render, every number in them finite and bounded."""
    events = [{"kind": "start", "time": 0.0},
              {"kind": "save", "time": 0.0, "step": 0, "tier": "durable", "blocked_s": 5e-324, "total_s": total,
               "bytes": (1 << 63) - 1, "files": 2},
              {"kind": "progress", "time": 5e-324, "step": 1},
              {"kind": "start", "time": 1e12 - 1}, {"kind": "progress", "time": 1e12, "step": 2}]
    (tmp_path / RECORD_NAME).write_bytes(dump(events))
    for extra in ([], ["--json"], ["--html", str(tmp_path / "page.html")]):
        out = ckptio_here("report", tmp_path, "--probe-mib", "1", *extra)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (extra, out.stderr[-2000:])
        assert "inf" not in out.stdout.lower() and "nan" not in out.stdout.lower(), out.stdout
        if extra == ["--json"]:
            json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert (tmp_path / "page.html").stat().st_size > 1000
