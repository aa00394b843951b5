"""The megatron-core runs shared by the test files (``fixture_cache.built``): one build per run and session however many
processes ask for it at once, the same run for the same options in any order, a failed build left nowhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fixture_cache

pytestmark = pytest.mark.slow  # the shared runs serve the slow tests (megatron-core's, DeepSpeed's) only

# a stand-in for a megatron-core script: it notes each build in COUNT, takes a while, and writes its --out folder
SCRIPT = """
import argparse, os, sys, time
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--tp", default="1")
ap.add_argument("--pp", default="1")
ap.add_argument("--fail", action="store_true")
a = ap.parse_args()
with open(os.environ["COUNT"], "a") as f:
    f.write(f"{a.tp} {a.pp}\\n")
if a.fail:
    sys.exit("the run broke")
os.makedirs(a.out)
time.sleep(1.5)
open(os.path.join(a.out, "done.txt"), "w").write(f"{a.tp} {a.pp}")
"""


@pytest.fixture
def script(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "megatron_stand_in.py"
    path.write_text(SCRIPT)
    monkeypatch.setenv(fixture_cache.CACHE_ENV, str(tmp_path / "runs"))
    monkeypatch.setenv("COUNT", str(tmp_path / "count.txt"))
    return path


def _ask(script: Path, *args: str) -> subprocess.Popen:
    code = "import sys, fixture_cache; print(fixture_cache.built(sys.argv[1], *sys.argv[2:]))"
    return subprocess.Popen([sys.executable, "-c", code, str(script), *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})


def test_two_processes_asking_at_once_share_one_build(script, tmp_path):
    procs = [_ask(script, "--tp", "2", "--pp", "1"), _ask(script, "--pp", "1", "--tp", "2")]  # another order
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] and Path(outs[0]).parent == tmp_path / "runs"
    assert (Path(outs[0]) / "done.txt").read_text() == "2 1"
    assert (tmp_path / "count.txt").read_text() == "2 1\n"  # the second process waited for the first one's build
    again = fixture_cache.built(str(script), "--tp", "2")  # other options: another run
    assert again != Path(outs[0]) and (again / "done.txt").read_text() == "2 1"
    assert (tmp_path / "count.txt").read_text() == "2 1\n2 1\n"
    log = (tmp_path / "runs" / "runs.log").read_text().splitlines()
    assert [line.split()[0] for line in log] == ["built", "reused", "built"], log


def test_a_failed_build_names_the_run_and_leaves_no_folder(script, tmp_path):
    for _ in range(2):  # nothing of the first attempt is taken for a run: the second one builds again
        with pytest.raises(RuntimeError, match="megatron_stand_in.py --fail failed:\n.*the run broke"):
            fixture_cache.built(str(script), "--fail")
    assert (tmp_path / "count.txt").read_text() == "1 1\n1 1\n"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if not p.name.endswith(".lock")) == []


def test_the_runs_live_in_this_sessions_temporary_folder(megatron_runs, tmp_path_factory):
    """Under xdist the workers' temporary folders are ``pytest-N/popen-gwK``: the runs sit in ``pytest-N``, which only
    this session's workers share; alone, in this session's own ``pytest-N``."""
    base = tmp_path_factory.getbasetemp()
    assert megatron_runs.parent == (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)
    assert os.environ[fixture_cache.CACHE_ENV] == str(megatron_runs)


def test_what_a_test_writes_into_a_shared_run_is_found(script, tmp_path):
    run = fixture_cache.built(str(script), "--tp", "3")
    assert fixture_cache.changed(tmp_path / "runs") == []
    (run / "done.txt").write_text("3 1 and more")
    (run / "new").mkdir()
    assert fixture_cache.changed(tmp_path / "runs") == [f"{run}/done.txt", f"{run}/new"]
