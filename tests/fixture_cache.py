"""The megatron-core and DeepSpeed runs the tests build (``megatron_fixture.py``, ``megatron_distopt_chunks.py``,
``ds_run.py``: a tiny model trained and saved on gloo ranks, tens of seconds each), built once per test session and
shared by every test file and fuzz family that asks for the same run, on one xdist worker or several.

:func:`built` and :func:`ds_run` key a run by a hash of the scripts it runs, its arguments, and the versions of the
packages it runs. The runs live under the session's own temporary folder (``CACHE_ENV``, set by ``conftest.py`` for
each session: under xdist the folder its workers' temporary folders sit in), so nothing outlives the session and a
code change can never meet an old run. A lock per run has a second worker wait for the first one's build instead of
building it again; a run is built in a temporary folder and renamed into place whole, so a run folder that exists is
complete.

The runs are shared: a test reads them and never writes into them (it copies what it wants to change)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
CACHE_ENV = "CKPTIO_FIXTURE_CACHE"
"""The session's folder of runs (set by ``conftest.py``); without it :func:`built` builds into a folder of its own."""


def session_folder(tmp_path_factory) -> Path:
    """This session's folder of runs: beside the xdist workers' temporary folders (their parent, the session's
    ``pytest-N``, which only this session's workers share), or in the session's own temporary folder without xdist."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return base / "megatron-runs"


def _options(args: tuple[str, ...]) -> list[list[str]]:
    """``args`` as the scripts' argparse reads them: each ``--option`` with its values, in a fixed order."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return sorted(groups)


def fingerprint(*parts, files: tuple[Path, ...] = ()) -> str:
    """A run's identity: ``parts`` (its script, options, package versions) and the bytes of ``files`` (the code it
    runs)."""
    h = hashlib.sha256(json.dumps(parts).encode())
    for path in sorted(files):
        h.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:20]


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cached(name: str, identity: str, build: Callable[[Path], None], what: str) -> Path:
    """The folder ``build(folder)`` makes, made once per session for ``identity`` (:func:`fingerprint`), whichever
    process asks first; the others wait for it and share it (read it, never write into it). Each build or reuse is one
    line of ``runs.log`` in the session's folder (``what``: the run, for that line)."""
    base = os.environ.get(CACHE_ENV)
    if not base:  # outside a test session (a script of tools/ run by hand): a folder of its own, as before
        out = Path(tempfile.mkdtemp(prefix=f"{name}-")) / "run"
        build(out)
        return out
    root = Path(base)
    root.mkdir(parents=True, exist_ok=True)
    name = f"{name}-{identity}"
    final = root / name
    start = time.perf_counter()
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits here for the first one's build
        waited = time.perf_counter() - start
        if final.is_dir():
            _note(root, name, "reused", waited, what)
            return final
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            build(scratch / "run")
            os.rename(scratch / "run", final)  # whole or not at all
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        (root / f"{name}.json").write_text(json.dumps(_listing(final)))
        _note(root, name, "built", time.perf_counter() - start - waited, what)
    return final


def built(script: str, *args: str, timeout: float = 300) -> Path:
    """The folder ``tests/<script> ARGS --out FOLDER`` (a megatron-core run) writes, built once per session
    (:func:`cached`), keyed by the megatron scripts' bytes (every ``tests/megatron_*.py``: they import each other),
    ``script``, its options in any order, and the megatron-core and torch versions."""
    if "--out" in args:
        raise ValueError("built() chooses --out itself")

    def build(out: Path) -> None:
        run = subprocess.run([sys.executable, str(HERE / script), *args, "--out", str(out)], capture_output=True,
                             text=True, timeout=timeout, start_new_session=True)
        if run.returncode != 0:
            raise RuntimeError(f"megatron-core run {script} {' '.join(args)} failed:\n{run.stderr[-3000:]}")

    identity = fingerprint(script, _options(args), version("megatron-core"), version("torch"),
                           files=tuple(HERE.glob("megatron_*.py")))
    return cached(Path(script).stem, identity, build, " ".join(args))


def ds_run(*args: str, ranks: int = 2) -> Path:
    """The run folder ``tests/ds_run.py FOLDER ARGS`` writes on ``ranks`` ranks under the real torchrun (DeepSpeed
    on CPU), built once per session (:func:`cached`): test_deepspeed.py, test_deepspeed_cli.py and the deepspeed fuzz
    family build the same runs. Keyed by ``args`` as given, ``ranks``, ``ds_run.py`` and ``toy.py`` (the model), and
    the DeepSpeed and torch versions."""
    from distributed import launch

    def build(out: Path) -> None:
        r = launch(str(HERE / "ds_run.py"), str(out), *args, ranks=ranks, real=True, env={"DS_ACCELERATOR": "cpu"},
                   timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"DeepSpeed run {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")

    identity = fingerprint("ds_run.py", list(args), ranks, version("deepspeed"), version("torch"),
                           files=(HERE / "ds_run.py", HERE / "toy.py"))
    return cached("ds_run", identity, build, f"{' '.join(args)} on {ranks} ranks")


def _listing(folder: Path) -> dict[str, list[int] | None]:
    """Every file (its size and modification time) and folder below ``folder``."""
    out: dict[str, list[int] | None] = {}
    for path in sorted(folder.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(folder))] = [st.st_size, st.st_mtime_ns] if path.is_file() else None
    return out


def changed(root: Path) -> list[str]:
    """What the tests changed in the runs under ``root`` since they were built (each path added, removed or
    rewritten): nothing, since a test only reads them."""
    out = []
    for record in sorted(root.glob("*.json")):
        folder = root / record.stem
        was = json.loads(record.read_text())
        now = _listing(folder) if folder.is_dir() else {}
        out += [f"{folder}/{p}" for p in sorted(set(was) | set(now)) if was.get(p, 0) != now.get(p, 0)]
    return out


def _note(root: Path, name: str, happened: str, seconds: float, what: str) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(root / "runs.log", "a") as log:
        log.write(f"{happened} {seconds:.1f}s {worker} {name} {what}\n")
