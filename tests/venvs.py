"""Virtual environments that tests build once and keep: the lower-bound packages, NeMo AutoModel's pins."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run ``cmd``; a failure fails the test with the end of its output."""
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def cached_venv(name: str, cache_variable: str, key: bytes, install: Callable[[list[str], Path], None]) -> Path:
    """The Python of a virtual environment under ``~/.cache/<name>/<hash>`` (``$cache_variable`` moves it), one
    per content of ``key`` and Python version. Built on first use by ``install(pip, env)``; a build cut short is
    started over."""
    digest = hashlib.sha256(key + sys.version.encode()).hexdigest()[:12]
    env = Path(os.environ.get(cache_variable, Path.home() / ".cache" / name)) / digest
    python = env / "bin" / "python"
    if (env / "ready").is_file():
        return python
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "venv", str(env)], timeout=300)
    install([str(python), "-m", "pip", "--disable-pip-version-check", "install", "--quiet"], env)
    (env / "ready").write_text("built\n")
    return python
