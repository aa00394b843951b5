"""Saving on preemption (issue 68): a signal makes the manager save at the next ``maybe_save()`` on every rank, at one
step all ranks agree on, then exit or hand control back; the handler it replaced still runs and comes back at close.

The distributed cases run a plain loop of one's own (``tests/preempt_loop.py``) under the real ``torchrun`` with 2
ranks: SIGTERM to torchrun's agent (which passes it on to its workers), and SIGTERM to one worker alone."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager, committed_checkpoints
from ckptio.errors import ConfigError

HERE = Path(__file__).resolve().parent
LOOP = str(HERE / "preempt_loop.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}


# ------------------------------------------------------------------------------------------ one process, in here
def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def own_handler():
    """A handler of the script's own (a framework's) on SIGTERM, as it was before the manager; put back after."""
    calls: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    mine = signal.getsignal(signal.SIGTERM)
    try:
        yield calls, mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_signal_saves_at_the_next_maybe_save_chains_to_the_handler_it_replaced_and_gives_it_back(tmp_path,
                                                                                                   own_handler):
    calls, mine = own_handler
    model, opt = _model()
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=tmp_path, persist_every_steps=100,
                                             on_preemption="return"), model=model, optimizer=opt)
    assert signal.getsignal(signal.SIGTERM) is not mine
    assert mgr.maybe_save(step=1) is None and not mgr.preempted
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == [signal.SIGTERM], "the handler the manager replaced was not called"
    assert [e.step for e in committed_checkpoints(tmp_path)] == [], "the handler itself must not save"
    path = mgr.maybe_save(step=2)
    assert mgr.preempted == signal.SIGTERM and path is not None and path.name.endswith("_step_2")
    assert [e.step for e in committed_checkpoints(tmp_path)] == [2]
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) is mine, "close() did not give the previous handler back"


def test_exit_mode_closes_the_manager_and_exits_after_the_save(tmp_path, own_handler):
    model, opt = _model()
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=tmp_path, persist_every_steps=100, on_preemption="exit",
                                             preemption_signals=["SIGUSR1", "SIGTERM"]), model=model, optimizer=opt)
    before = signal.getsignal(signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.raises(SystemExit) as exited:
        mgr.maybe_save(step=3)
    assert exited.value.code == 0 and mgr.preempted == signal.SIGUSR1
    assert [e.step for e in committed_checkpoints(tmp_path)] == [3]
    assert signal.getsignal(signal.SIGTERM) is own_handler[1]  # closed: both handlers given back
    assert signal.getsignal(signal.SIGUSR1) is not before
    mgr.close()  # a `with` block or a `finally` closes it again: harmless


def test_off_by_default_no_handler_is_installed(tmp_path, own_handler):
    model, opt = _model()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=tmp_path), model=model, optimizer=opt):
        assert signal.getsignal(signal.SIGTERM) is own_handler[1]


def test_a_grace_period_too_short_for_a_durable_save_takes_the_memory_snapshot_first(tmp_path, own_handler, caplog):
    model, opt = _model()
    cfg = dict(checkpoint_dir=str(tmp_path / "c"), persist_every_steps=100, memory_every_steps=100,
               memory_dir=str(tmp_path / "mem"), on_preemption="return")
    with CheckpointManager(CheckpointConfig(**cfg), model=model, optimizer=opt) as mgr:
        mgr.save(step=1)  # the run's record now holds what a durable save costs here
    os.makedirs(tmp_path / "mem", exist_ok=True)
    with CheckpointManager(CheckpointConfig(**cfg, preemption_grace=0.001), model=model, optimizer=opt) as mgr:
        mgr.restore()
        caplog.clear()
        os.kill(os.getpid(), signal.SIGTERM)
        mgr.maybe_save(step=5)
        said = caplog.text
        assert mgr.memory_tier.last["step"] == 5, "no memory snapshot was taken before the durable save"
        assert "grace" in said and "memory" in said, said
    assert [e.step for e in committed_checkpoints(tmp_path / "c")] == [1, 5]


@pytest.mark.parametrize("settings, words", [
    (dict(on_preemption="stop"), ["on_preemption", "exit", "return"]),
    (dict(on_preemption="exit", preemption_signals=["SIGTREM"]), ["preemption_signals", "SIGTREM", "SIGTERM"]),
    (dict(on_preemption="exit", preemption_signals=["SIGKILL"]), ["preemption_signals", "SIGKILL", "cannot"]),
    (dict(on_preemption="exit", preemption_grace="soon"), ["preemption_grace", "soon"]),
    (dict(preemption_grace="30s"), ["preemption_grace", "on_preemption"]),
])
def test_bad_settings_name_the_field(settings, words):
    with pytest.raises(ConfigError) as err:
        CheckpointConfig(**settings)
    for word in words:
        assert word in str(err.value), str(err.value)


# ---------------------------------------------------------------------------- 2 ranks under the real torchrun
def _start(folder: Path, max_steps: int, mode: str):
    from forked_scripts import Interpreters

    return Interpreters(LOOP, str(folder), str(max_steps), mode, ranks=2, env=ENV, merged=True)


def _preempt(folder: Path, mode: str, whom: str) -> tuple[int, str]:
    """Start the loop on 2 ranks, send SIGTERM (to the agent or to rank 1 alone) after step 5, return (exit code,
    output)."""
    job = _start(folder, 2000, mode)
    lines: list[str] = []
    sent = False
    deadline = time.monotonic() + 240
    try:
        for line in job.lines(240):
            lines.append(line)  # the two ranks' lines may interleave: what they say is searched in the whole
            text = "".join(lines)
            pids = {int(r): int(p) for r, p in re.findall(r"rank (\d) pid (\d+)", text)}
            if not sent and re.search(r"rank 0 step 5(?!\d)", text) and len(pids) == 2:
                os.kill(job.proc.pid if whom == "agent" else pids[1], signal.SIGTERM)
                sent = True
            assert time.monotonic() < deadline, "".join(lines)[-4000:]
        done = job.wait(120)
    finally:
        if job.proc.poll() is None:
            job.signal(signal.SIGKILL)
    text = "".join(lines) + done.stdout
    assert sent, text[-4000:]
    return done.returncode, text


def _stopped_at(text: str) -> int:
    steps = {int(r): int(s) for r, s in re.findall(r"rank (\d) preempted at (\d+)", text)}
    assert sorted(steps) == [0, 1], f"not every rank stopped on the signal: {steps}\n{text[-4000:]}"
    assert steps[0] == steps[1], f"the ranks stopped at different steps: {steps}"
    return steps[0]


def _resumes(folder: Path, at: int) -> None:
    done = _start(folder, at + 3, "return").wait(240)
    assert done.returncode == 0, done.stdout[-4000:]
    resumed = sorted(re.findall(rf"rank (\d) resumed at {at}(?!\d)", done.stdout))
    assert resumed == ["0", "1"], done.stdout[-4000:]
    ran = {(int(r), int(s)) for r, s in re.findall(r"rank (\d) step (\d+)", done.stdout)}
    assert ran == {(r, s) for r in (0, 1) for s in range(at + 1, at + 4)}, sorted(ran)  # none lost, none repeated


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exit", "return"])
def test_sigterm_to_torchrun_saves_one_step_on_both_ranks_and_a_rerun_resumes_from_it(tmp_path, mode):
    code, text = _preempt(tmp_path / "c", mode, "agent")
    at = _stopped_at(text)
    assert at >= 5 and [e.step for e in committed_checkpoints(tmp_path / "c")] == [at], text[-4000:]
    # the workers ended cleanly; the agent turns the signal it got into its own error exit (SignalException)
    assert "ChildFailedError" not in text and text.count("Traceback") == text.count("SignalException: ") <= 1, \
        text[-4000:]
    _resumes(tmp_path / "c", at)


@pytest.mark.slow
def test_sigterm_to_one_rank_alone_stops_both_at_the_same_step(tmp_path):
    code, text = _preempt(tmp_path / "c", "return", "rank1")
    assert code == 0, text[-4000:]  # the agent got nothing: every worker ended with 0
    at = _stopped_at(text)
    assert at >= 5 and [e.step for e in committed_checkpoints(tmp_path / "c")] == [at], text[-4000:]
    assert "SIGTERM" in text and "another rank" in text, text[-4000:]  # rank 0 says why it stops
    _resumes(tmp_path / "c", at)
