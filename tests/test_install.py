"""Installing ckptio into a training environment leaves the user's torch and transformers as they were.

The environment under test is the one running this suite (the tested set of ``scripts/constraints.txt``):
a new virtual environment sees its packages through a ``.pth`` line, and the real ``pip`` installs ckptio
(built from a copy of this checkout, with its ``hf`` and ``recipe`` extras) into it with no package index
to fetch from — so the install succeeds only if every requirement ckptio declares is already met, and
pip's own report must list ckptio as the one package it installs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _copy_sources(dest: Path) -> Path:
    """What a source distribution holds, copied so that building it writes nothing into the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dest


def _versions(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def _overlay_env(where: Path) -> Path:
    """A new venv (no pip of its own) that sees this suite's packages after its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "tested-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_pip_install_into_an_environment_with_torch_and_transformers_moves_neither(tmp_path):
    src = _copy_sources(tmp_path / "ckptio-src")
    python = _overlay_env(tmp_path / "env")
    before = _versions(python)
    assert "torch" in before and "transformers" in before and "peft" in before

    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "install", "--no-index", "--no-build-isolation"]
    report = tmp_path / "report.json"
    dry = subprocess.run(pip + ["--dry-run", "--quiet", "--report", str(report), f"{src}[hf,recipe,s3]"],
                         capture_output=True, text=True, timeout=600)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    planned = {item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    assert list(planned) == ["ckptio"], f"pip would also install or change {planned}"

    real = subprocess.run(pip + ["--quiet", f"{src}[hf,recipe,s3]"], capture_output=True, text=True, timeout=600)
    assert real.returncode == 0, real.stdout + real.stderr
    after = _versions(python)
    assert {k: v for k, v in after.items() if k != "ckptio"} == {k: v for k, v in before.items() if k != "ckptio"}
    assert after["torch"] == before["torch"] and after["transformers"] == before["transformers"]

    # the installed copy is the one that runs, console script included
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a checkout's src/ must not shadow it
    where = subprocess.run([str(python), "-c", "import ckptio, sys; print(ckptio.__file__)"],
                           capture_output=True, text=True, check=True, timeout=120, env=clean).stdout.strip()
    assert where.startswith(str(tmp_path / "env")), where
    help_ = subprocess.run([str(tmp_path / "env" / "bin" / "ckptio"), "--help"], capture_output=True, text=True,
                           timeout=120)
    assert help_.returncode == 0 and "convert" in help_.stdout
    typed = Path(where).parent / "py.typed"
    assert typed.is_file(), "py.typed is not in the installed package"
