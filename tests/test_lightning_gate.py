"""Every byte the Lightning integration reads goes through the one gate (issue 37), proven on folders and files the
real ``pytorch_lightning`` wrote.

``trainer_state.pt`` of a ``CkptioCheckpointIO`` folder describes the rest of Lightning's dict; a hostile or damaged
one (keys of the wrong type, a skeleton nested thousands deep, a tensor count far beyond what the folder holds) is
refused with a ckptio error naming it, before anything is built from it, even when its manifest vouches for its
bytes. Lightning's own ``.ckpt`` files, read by ``convert``/``inspect`` and by the plugin, meet the same rules.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from lit_tiny import fit  # noqa: E402

from ckptio import CheckpointCorruptError  # noqa: E402
from ckptio.formats.lightning import read_lightning  # noqa: E402
from ckptio.lightning import CkptioCheckpointIO, read_checkpoint  # noqa: E402
from ckptio.engine.manifest import Manifest  # noqa: E402
from ckptio.storage.checksum import bytes_checksum  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One epoch of the tiny module, checkpointed by the plugin (``ours``) and by Lightning itself (``theirs``)."""
    root = tmp_path_factory.mktemp("runs")
    fit(root / "ours", 1, [CkptioCheckpointIO()], save_last=True)
    fit(root / "theirs", 1, save_last=True)
    return root


def _deep(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels):
        value = {"a": value}
    return value


def _pt_bytes(obj: object) -> bytes:
    buf, limit = io.BytesIO(), sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # pickling a deep structure recurses once per level
    try:
        torch.save(obj, buf)
    finally:
        sys.setrecursionlimit(limit)
    return buf.getvalue()


def _tampered(runs: Path, tmp_path: Path, edit) -> Path:
    """A copy of the plugin's ``last.ckpt`` whose ``trainer_state.pt`` is ``edit(meta)``, with a manifest re-made to
    vouch for the new bytes (sizes and checksums agree: only the parser can refuse it)."""
    folder = tmp_path / "last.ckpt"
    shutil.copytree(runs / "ours" / "last.ckpt", folder)
    meta = torch.load(folder / "trainer_state.pt", weights_only=True)
    data = _pt_bytes(edit(meta))
    (folder / "trainer_state.pt").write_bytes(data)
    manifest = Manifest.from_json((folder / "manifest.json").read_text(), folder / "manifest.json")
    manifest.files["trainer_state.pt"] = len(data)
    manifest.checksums["trainer_state.pt"] = bytes_checksum(data)
    (folder / "manifest.json").write_text(manifest.to_json())
    return folder


def test_the_untouched_folder_reads(runs, tmp_path):
    assert read_checkpoint(_tampered(runs, tmp_path, lambda meta: meta))["global_step"] == 8


@pytest.mark.parametrize("edit", [
    pytest.param(lambda m: {**m, "model_keys": [["a"]]}, id="model_keys-of-lists"),
    pytest.param(lambda m: {**m, "state_dict_keys": [{"x": 1}]}, id="state_dict_keys-of-dicts"),
    pytest.param(lambda m: {**m, "skeleton": {**m["skeleton"], "callbacks": _deep(3000)}}, id="nested-3000-deep"),
    pytest.param(lambda m: {**m, "tensors": "12"}, id="count-a-string"),
    pytest.param(lambda m: {**m, "tensors": -1}, id="count-negative"),
    pytest.param(lambda m: {**m, "tensors": 10**400}, id="count-400-digits"),
    pytest.param(lambda m: [m], id="not-a-mapping"),
    pytest.param(lambda m: {**m, "skeleton": [m["skeleton"]]}, id="skeleton-a-list"),
])
def test_a_hostile_trainer_state_is_refused_naming_the_file(runs, tmp_path, edit):
    folder = _tampered(runs, tmp_path, edit)
    with pytest.raises(CheckpointCorruptError, match="trainer_state.pt"):
        read_checkpoint(folder)


def test_resume_from_a_hostile_trainer_state_is_refused_by_the_trainer(runs, tmp_path):
    """Through Lightning's own ``fit(ckpt_path=...)``: the error that stops the fit is ckptio's, naming the file."""
    folder = _tampered(runs, tmp_path, lambda m: {**m, "model_keys": [["a"]]})
    with pytest.raises(CheckpointCorruptError, match="trainer_state.pt"):
        fit(tmp_path / "run", 2, [CkptioCheckpointIO()], ckpt_path=str(folder))


_COUNT = """
import resource, sys, time
sys.path.insert(0, {tests!r})
from ckptio.lightning import read_checkpoint
from ckptio import CheckpointCorruptError
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))  # 1 GiB more than now
start = time.monotonic()
try:
    read_checkpoint({folder!r})
except CheckpointCorruptError as exc:
    print("REFUSED", round(time.monotonic() - start, 2), exc)
"""


def test_a_tensor_count_beyond_the_folder_is_refused_before_anything_is_built(runs, tmp_path):
    """``"tensors": 10**9`` in a 1 KB file: checked against the tensors ``state/`` holds, in well under a second and
    within 1 GiB of address space (a list of 10**9 names alone would need tens of GiB)."""
    folder = _tampered(runs, tmp_path, lambda m: {**m, "tensors": 10**9})
    assert (folder / "trainer_state.pt").stat().st_size < 16_000
    code = _COUNT.format(tests=str(Path(__file__).parent), folder=str(folder))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("REFUSED"), (done.stdout + done.stderr)[-2000:]
    seconds = float(done.stdout.split()[1])
    assert seconds < 5 and "trainer_state.pt" in done.stdout and "1000000000" in done.stdout, done.stdout


def test_a_skeleton_too_deep_to_read_back_is_refused_before_writing(tmp_path):
    from ckptio.lightning import write_checkpoint

    with pytest.raises(ValueError, match="deeper than"):
        write_checkpoint({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": _deep(80)}, tmp_path / "x.ckpt")
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ Lightning's own .ckpt files (convert, inspect)
def _lightning_file(runs: Path, tmp_path: Path, edit) -> Path:
    ckpt = torch.load(runs / "theirs" / "last.ckpt", weights_only=True)
    path = tmp_path / "edited.ckpt"
    path.write_bytes(_pt_bytes(edit(ckpt)))
    return path


@pytest.mark.parametrize("edit", [
    pytest.param(lambda c: {**c, "callbacks": _deep(3000)}, id="nested-3000-deep"),
    pytest.param(lambda c: {**c, "state_dict": {("net", 0): torch.ones(1)}}, id="key-not-a-string"),
    pytest.param(lambda c: {**c, "global_step": 10**400}, id="step-400-digits"),
    pytest.param(lambda c: {**c, "epoch": -3}, id="epoch-negative"),
    pytest.param(lambda c: {**c, "global_step": True}, id="step-a-bool"),
])
def test_a_hostile_lightning_file_is_refused_naming_it(runs, tmp_path, edit):
    """The reader ``ckptio convert``/``inspect`` use, and the plugin's own load of a ``.ckpt`` file."""
    from ckptio.formats import registry

    path = _lightning_file(runs, tmp_path, edit)
    with pytest.raises(CheckpointCorruptError, match="edited.ckpt"):
        read_lightning(path)
    with pytest.raises(CheckpointCorruptError, match="edited.ckpt"):
        registry.detect(path).open(path)
    with pytest.raises(CheckpointCorruptError, match="edited.ckpt"):
        read_checkpoint(path)


def test_lightnings_own_file_still_reads(runs):
    from ckptio.formats import registry

    path = runs / "theirs" / "last.ckpt"
    assert read_lightning(path)["global_step"] == 8
    assert registry.detect(path).open(path).step == 8
