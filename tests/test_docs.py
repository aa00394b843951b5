"""The documentation site builds from the repository with warnings as errors: a broken link, a missing
page, an API name that moved or a docstring mkdocstrings cannot parse fails here, not on the website."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).parent / "mkdocs"


@pytest.mark.skipif(not MKDOCS.exists() and shutil.which("mkdocs") is None,
                    reason="mkdocs is not installed (pip install 'ckptio[docs]'); CI installs it")
def test_docs_build_strict(tmp_path):
    exe = str(MKDOCS) if MKDOCS.exists() else shutil.which("mkdocs")
    out = subprocess.run([exe, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    site = tmp_path / "site"
    cli = (site / "cli" / "index.html").read_text()
    for command in ("inspect", "list", "verify", "prune", "consolidate", "convert", "nemo", "quantize"):
        assert f"ckptio {command}" in cli, f"the generated CLI reference lacks {command}"
    api = (site / "api" / "index.html").read_text()
    assert "model_save_format" in api and "restore_from" in api  # fields documented from the docstrings
    for page in ("migrate-automodel", "migrate-lightning", "migrate-dcp", "migrate-hf-trainer"):
        assert (site / page / "index.html").is_file()
    assert not (site / "hooks.py").exists()
