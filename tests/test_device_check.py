"""``tools/device_check.py``, the GPU checks ready for a machine that has one: without CUDA it says so in one
line and succeeds; ``--device cpu`` runs every check end to end on the CPU (bitwise restores in every format, in
the background and through the memory tier, staging buffers reused, memory back to level, a process group)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "device_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script runs its checks instead")
def test_without_a_gpu_it_says_so_in_one_line_and_succeeds():
    out = _run()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().count("\n") == 0 and "no CUDA device here" in out.stdout


@pytest.mark.slow  # ~20 s: a dozen saves and restores, a process group
def test_on_the_cpu_every_check_runs_and_passes(tmp_path):
    out = _run("--device", "cpu", "--mb", "4", "--saves", "3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert len(rows) == 13 and all(r.startswith("ok") for r in rows), out.stdout
    for what in ("bitwise: safetensors, background", "bitwise: torch_save, synchronous", "bitwise: memory tier",
                 "staging: the same buffers", "process group (gloo)", "pause: save() blocked",
                 "blocked ÷ host copy, wait_for_staging"):
        assert any(what in r for r in rows), what
    assert "13 of 13 checks passed" in out.stdout
