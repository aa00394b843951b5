"""``CkptioAccelerator(..., ckptio_checkpoint_dir="s3://bucket/run")``: ``save_state()`` and ``load_state()`` with
accelerate's ``checkpoint_N`` folders in object storage (``gs://``, ``az://`` alike), against real loopback servers
and the real accelerate.

Proven here: the folders are committed steps in the bucket (manifest last), none in the local ``project_dir``;
``total_limit`` rotates them there; a stopped run resumed with ``load_state()`` passes over a torn folder and ends
bitwise equal to the run uninterrupted, in the foreground and with ``async_save``; ``load_state(url)`` loads a named
one; on 2 ranks (torchrun) each rank uploads its own files, rank 0 commits, a kill before a commit leaves no
committed torn folder (the rerun resumes bitwise equal to the uninterrupted 2-rank run) and a rank's failed upload
in the background commits nothing and is raised on both ranks.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from acc_tiny import Counter, train  # noqa: E402
from distributed import launch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from ckptio.accelerate import CkptioAccelerator  # noqa: E402

RUNNER = str(Path(__file__).resolve().parent / "acc_run.py")


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    out = train(tmp_path_factory.mktemp("straight"), Accelerator)
    out.pop("main")
    return out



@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_saved_rotated_and_resumed_in_the_bucket_bitwise(store, tmp_path, straight, caplog, async_save):
    if store.scheme != "s3" and async_save:
        pytest.skip("the background path is the same on every store: s3 only")
    cls = functools.partial(CkptioAccelerator, ckptio_checkpoint_dir=store.url("run"), async_save=async_save)
    train(tmp_path / "first", cls, stop=7, limit=2)  # saves after steps 3 and 6
    assert not (tmp_path / "first" / "checkpoints").exists()
    folders = store.folders()
    assert sorted(n for n in folders if n.startswith("checkpoint_")) == ["checkpoint_0", "checkpoint_1"]
    manifest = json.loads(store.get("run/checkpoint_1/manifest.json"))
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "custom_checkpoint_0.pkl"} <= set(manifest["files"]) == folders["checkpoint_1"] - {"manifest.json"}
    # a torn checkpoint_2 (a save cut short: no manifest) is passed over
    for rel in folders["checkpoint_1"] - {"manifest.json"}:
        store.put(f"run/checkpoint_2/{rel}", store.get(f"run/checkpoint_1/{rel}"))
    out = train(tmp_path / "second", cls, resume=True, limit=2)
    out.pop("main")
    _same(out, straight, "stopped at 7, resumed from checkpoint_1 in the bucket")
    assert "skipping checkpoint_2" in caplog.text
    # the numbers went on after checkpoint_1 (checkpoint_2 written over the torn one), total_limit=2 applied there
    assert sorted(n for n in store.folders() if n.startswith("checkpoint_")) == ["checkpoint_2", "checkpoint_3"]
    acc, counter = cls(cpu=True), Counter()  # a named folder of the bucket loads too
    acc.register_for_checkpointing(counter)
    assert acc.load_state(store.url("run/checkpoint_3")) == store.url("run/checkpoint_3")
    assert acc.project_configuration.iteration == 4 and counter.n == 12
    acc.end_training()


def _run(*args: str, ok: bool = True) -> str:
    done = launch(RUNNER, *args, ranks=2)
    text = done.stdout + done.stderr
    assert (done.returncode == 0) == ok, text[-4000:]
    return text


@pytest.mark.slow
def test_two_ranks_killed_before_a_commit_then_resumed_from_the_bucket_end_bitwise_equal(bucket, tmp_path):
    """2 DDP ranks (torchrun) save_state into the bucket, each uploading its own RNG file; rank 0 is SIGKILLed before
    the manifest of its second save (checkpoint_1 uploaded, not committed, its lease left behind); the rerun takes
    the lease over, resumes from checkpoint_0 and ends bitwise equal to the plain Accelerator's uninterrupted run.
    With ``async_save``, rank 1's upload failing in the background commits nothing and is raised on both ranks."""
    from conftest import Store

    store = Store("s3", bucket)
    _run(str(tmp_path / "plain"), str(tmp_path / "straight.pt"), "--plain")
    _run(str(tmp_path / "a"), str(tmp_path / "x.pt"), "--bucket", store.url("run"), "--kill-at",
         "commit.before_manifest:2", ok=False)
    folders = store.folders()
    assert "manifest.json" in folders["checkpoint_0"] and "manifest.json" not in folders["checkpoint_1"]
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= folders["checkpoint_1"]
    _run(str(tmp_path / "b"), str(tmp_path / "resumed.pt"), "--bucket", store.url("run"), "--resume")
    _same(torch.load(tmp_path / "resumed.pt", weights_only=True),
          torch.load(tmp_path / "straight.pt", weights_only=True), "2 ranks, killed before a commit -> resumed")
    folders = store.folders()
    assert sorted(n for n in folders if n.startswith("checkpoint_")) == [f"checkpoint_{i}" for i in range(4)]
    for i in range(4):
        manifest = json.loads(store.get(f"run/checkpoint_{i}/manifest.json"))
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(manifest["files"]) == \
            folders[f"checkpoint_{i}"] - {"manifest.json"}, i
        assert manifest["world_size"] == 2
    assert not (tmp_path / "a" / "checkpoints").exists() and not (tmp_path / "b" / "checkpoints").exists()
    from ckptio.integrations.framework_async import WRITING

    text = _run(str(tmp_path / "c"), str(tmp_path / "failed.pt"), "--bucket", store.url("failed"), "--async",
                "--fail-at", f"{WRITING}:1", ok=False)
    assert re.search(r"writing .*checkpoint_0 failed on rank\(s\) \[1\]", text), text[-3000:]
    assert "No space left on device (injected" in text
    assert all("manifest.json" not in files for files in store.folders("failed").values())
