"""``ckptio report``: a run's record summed up in the terminal and as a self-contained page, which a real headless
Chromium renders (its charts drawn, no script error) from the record of a real run that was killed and resumed.

The browser is Debian's ``chromium``; ``scripts/test.sh`` installs it where it can (as in CI) and then requires it
(``CKPTIO_REQUIRE_BROWSER=1``): elsewhere the browser tests skip, saying why."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ckptio.cli.report_cmd import text as report_text
from ckptio.cli import main
from ckptio.goodput.record import RECORD_NAME, dump
from ckptio.goodput.summary import summarize

sys.path.insert(0, str(Path(__file__).parent))
from forked_scripts import run_script  # noqa: E402

_RUN = """
import os, signal, sys, time, torch
from ckptio import CheckpointConfig, CheckpointManager
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters())
mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=sys.argv[1], persist_every_steps=6, memory_every_steps=2,
                                         save_top_k=2), model=model, optimizer=opt)
info = mgr.restore()
for step in range((info.step if info else 0) + 1, 25):
    loss = model(torch.randn(4, 64)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)
    mgr.maybe_save(step=step, metrics={"loss": loss.item()})
    if step == int(sys.argv[2]):
        mgr.wait()  # the step-14 snapshot committed (it runs in the background; under load it may not be yet)
        os.kill(os.getpid(), signal.SIGKILL)
mgr.close()
"""


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A run killed (SIGKILL) at step 15 and rerun to step 24: durable saves every 6 steps (2 kept), memory
    snapshots every 2; the rerun resumes from the memory tier's step 14."""
    where = tmp_path_factory.mktemp("run")
    (where / "run.py").write_text(_RUN)
    root = where / "ckpt"
    killed = run_script(str(where / "run.py"), str(root), "15", timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    rerun = run_script(str(where / "run.py"), str(root), "0", timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    return root


def test_the_goodput_of_a_known_record_is_what_its_definition_gives():
    """Saves block 3 s in all, 5 steps of 1 s are redone, 10 s between the processes and 2 s to restore: 20 s of 50
    s are lost, 60 % goodput; one failure in 40 s of running."""
    events = [
        {"kind": "start", "time": 0.0, "ranks": 2},
        {"kind": "save", "time": 10.0, "step": 10, "tier": "durable", "blocked_s": 1.0, "total_s": 3.0},
        {"kind": "save", "time": 21.0, "step": 20, "tier": "durable", "blocked_s": 1.0, "total_s": 3.0},
        {"kind": "progress", "time": 26.0, "step": 25},
        {"kind": "start", "time": 36.0, "ranks": 2},
        {"kind": "restore", "time": 38.0, "step": 20, "tier": "durable", "steps_lost": 5, "startup_s": 5.0},
        {"kind": "save", "time": 49.0, "step": 30, "tier": "durable", "blocked_s": 1.0},
        {"kind": "remove", "time": 49.5, "step": 10},
        {"kind": "end", "time": 50.0},
    ]
    s = summarize(events)
    assert s.step_s == pytest.approx(1.0) and s.wall_s == 50.0 and s.blocked_s == 3.0
    assert s.redone_s == pytest.approx(5.0) and s.restarting_s == pytest.approx(12.0)
    assert s.goodput == pytest.approx(0.6) and s.failures == 1 and s.mtbf_s == pytest.approx(40.0)
    assert [e["step"] for e in s.removes] == [10] and s.newest_step == 30
    assert s.unseen_s == pytest.approx(10.0) and s.unseen_steps == 10  # 26 s to 36 s: not seen, within 30 s
    # the first process had spent 4 s on imports before its manager began: the run's set-up, in its wall time but
    # not a restart (issue 68: a run that never failed lost nothing to restarting)
    events[0]["age_s"] = 4.0
    events[4]["age_s"] = 3.0  # the second one's 3 s were between the two processes already: nothing changes
    s = summarize(events)
    assert s.wall_s == 54.0 and s.setup_s == 4.0 and s.restarting_s == pytest.approx(12.0)
    assert s.goodput == pytest.approx(34 / 54) and s.unseen_s == pytest.approx(7.0)


def test_a_clean_run_loses_nothing_to_restarting_and_a_failure_says_what_it_may_have_lost_unseen():
    """Issue 68: a short run that never failed reported 43.8 % goodput (its first start-up counted as restarting);
    a run killed 13 steps after its last save, within the 30 s between progress events, said 0 steps lost."""
    clean = [{"kind": "start", "time": 100.0, "ranks": 1, "age_s": 9.0},
             {"kind": "save", "time": 105.0, "step": 10, "tier": "durable", "blocked_s": 0.1},
             {"kind": "end", "time": 107.0}]
    s = summarize(clean)
    assert s.restarting_s == 0.0 and s.setup_s == 9.0 and s.goodput == pytest.approx(1 - 0.1 / 16)
    killed = [{"kind": "start", "time": 0.0, "ranks": 1}, {"kind": "progress", "time": 0.5, "step": 1},
              {"kind": "save", "time": 10.5, "step": 20, "tier": "durable", "blocked_s": 0.1},
              {"kind": "start", "time": 18.0, "ranks": 1},  # killed at step 33, 6.5 s after the save: relaunched
              {"kind": "restore", "time": 19.0, "step": 20, "tier": "durable", "steps_lost": 0}]
    s = summarize(killed)
    assert s.redone_s == 0.0 and s.unseen_s == pytest.approx(7.5) and s.unseen_steps == 15  # 0.5 s a step: >= 13
    text = report_text(s, "run", None)
    assert "up to 15 step(s) more not seen" in text, text
    unknown = killed[:1] + [{"kind": "start", "time": 18.0, "ranks": 1},
                            {"kind": "restore", "time": 19.0, "step": 20, "tier": "durable"}]
    assert "not known for 1 restore(s)" in report_text(summarize(unknown), "run", None)


def test_the_terminal_report_of_a_real_run(real_run, capsys):
    before = sorted(os.listdir(real_run))
    assert main(["report", str(real_run), "--probe-mib", "16"]) == 0
    out = capsys.readouterr().out
    assert sorted(os.listdir(real_run)) == before  # the storage's probe is gone
    assert re.search(r"goodput \(estimated\)\s+\d+\.\d %", out), out
    assert re.search(r"processes\s+2, failures 1", out) and re.search(r"storage write limit\s+[\d.]+ \w+/s", out)
    assert re.search(r"^durable\s+4\s", out, re.M) and re.search(r"^memory\s+\d+\s", out, re.M), out
    assert re.search(r"^14\s+memory\s+0\s", out, re.M), out  # resumed from the memory tier's step 14
    assert "Removed by retention: 2 checkpoint(s) (steps 6, 12)" in out
    assert "interval for the durable tier: every" in out and "learned from its failures" in out
    assert "Resume audit from step 14: exact: the 1 step(s) compared match the run that stopped bitwise" in out, out
    assert main(["report", str(real_run), "--json", "--probe-mib", "0"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [e["step"] for e in data["durable"]] == [6, 12, 18, 24] and data["failures"] == 1


def test_a_hostile_or_missing_record_is_refused_naming_it(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path}/{RECORD_NAME}: no run record" in capsys.readouterr().err
    (tmp_path / RECORD_NAME).write_bytes(dump([{"kind": "start", "time": 1.0}]).replace(b"start", b"boom!"))
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert RECORD_NAME in err and "unknown kind 'boom!'" in err, err
    (tmp_path / RECORD_NAME).write_bytes(b"[" * 100_000)
    assert main(["report", str(tmp_path)]) == 2
    assert RECORD_NAME in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ in a browser
def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CKPTIO_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium is not installed (scripts/test.sh installs Debian's package where it can)")
        pytest.skip("no chromium here: the report page's browser test needs Debian's chromium package")
    return exe


def _browse(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=5000"]
    out = subprocess.run([_chromium(), *flags, *args, page.as_uri()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow  # a real browser, three times
def test_the_page_of_a_real_run_renders_its_charts_in_chromium(real_run, tmp_path, capsys):
    page = tmp_path / "report.html"
    assert main(["report", str(real_run), "--html", str(page), "--probe-mib", "16"]) == 0
    text = page.read_text()
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text  # no network
    dom = _browse(page, tmp_path, "--dump-dom").stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-charts="4"' in body and "data-error" not in body, body
    svgs = re.findall(r"<svg.*?</svg>", dom, re.S)
    assert len(svgs) == 4
    timeline, times, sizes, memory = svgs
    assert timeline.count("<polyline") == 2 and timeline.count("<circle") >= 4 + 1 + 5  # both processes drawn
    assert 'stroke-dasharray="4 3"' in timeline  # the failure
    assert times.count("<rect") == 2 * 4 and times.count('stroke="#d7263d"') == 4  # each save against the limit
    assert sizes.count("<rect") == 4 and memory.count("<rect") >= 6
    assert re.search(r"<td>14</td><td>memory</td><td>0</td>", dom), "the restore's row"
    assert "Resume audit from step 14: exact" in dom, "the resume audit's line"
    # a screenshot: the page draws far more than an empty page of the same size does
    shot, blank = tmp_path / "report.png", tmp_path / "blank.png"
    _browse(page, tmp_path, "--window-size=1200,1800", "--hide-scrollbars", f"--screenshot={shot}")
    empty = tmp_path / "empty.html"
    empty.write_text("<!DOCTYPE html><html><body></body></html>")
    _browse(empty, tmp_path, "--window-size=1200,1800", "--hide-scrollbars", f"--screenshot={blank}")
    assert _png_size(shot) == _png_size(blank) == (1200, 1800)
    assert shot.stat().st_size > 8 * blank.stat().st_size, (shot.stat().st_size, blank.stat().st_size)


def test_no_text_of_the_run_is_markup_on_the_page(tmp_path, capsys):
    """A run folder named like markup is shown as text: nothing in it runs or is built as an element."""
    root = tmp_path / '<img src=x onerror="document.body.dataset.error=1">'
    root.mkdir()
    (root / RECORD_NAME).write_bytes(dump([{"kind": "start", "time": 1.0},
                                           {"kind": "save", "time": 5.0, "step": 3, "tier": "durable",
                                            "blocked_s": 0.5, "total_s": 1.0, "bytes": 4096, "files": 2}]))
    page = tmp_path / "page.html"
    assert main(["report", str(root), "--html", str(page), "--probe-mib", "0"]) == 0
    dom = _browse(page, tmp_path, "--dump-dom").stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-charts="3"' in body and "data-error" not in body, body  # no memory tier: said in words
    assert "No saves recorded." in dom and "<img" not in dom and "&lt;img src=x" in dom


def test_the_resume_audits_are_said_in_the_terminal_and_on_the_page(tmp_path, capsys):
    """An exact resume and one that diverged, as a run records them: one line each, values side by side, causes."""
    (tmp_path / RECORD_NAME).write_bytes(dump([
        {"kind": "start", "time": 1.0, "ranks": 1},
        {"kind": "save", "time": 5.0, "step": 3, "tier": "durable", "blocked_s": 0.5},
        {"kind": "audit", "time": 9.0, "step": 3, "verdict": "exact", "checked": 3},
        {"kind": "audit", "time": 12.0, "step": 3, "verdict": "diverged", "checked": 1, "at": 4, "loss": 2.5,
         "loss_was": 2.25, "lr": 0.001, "lr_was": 0.001, "causes": ["dataloader", "ranks"]}]))
    assert main(["report", str(tmp_path), "--probe-mib", "0"]) == 0
    out = capsys.readouterr().out
    assert "Resume audit from step 3: exact: the 3 step(s) compared match the run that stopped bitwise" in out
    line = next(x for x in out.splitlines() if "DIVERGED" in x)
    assert "DIVERGED at step 4: loss 2.5 now vs 2.25 recorded, lr 0.001 now vs 0.001 recorded" in line, line
    assert "no data loader given to the manager" in line and "another number of ranks" in line, line
    assert main(["report", str(tmp_path), "--json", "--probe-mib", "0"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [a["verdict"] for a in data["audits"]] == ["exact", "diverged"] and "DIVERGED" in data["audits"][1]["text"]
