"""``CkptioAccelerator(..., ckptio_checkpoint_dir="s3://bucket/run")``: ``save_state()`` and ``load_state()`` with
accelerate's ``checkpoint_N`` folders in object storage (``gs://``, ``az://`` alike), against real loopback servers
and the real accelerate.

Proven here: the folders are committed steps in the bucket (manifest last), none in the local ``project_dir``;
``total_limit`` rotates them there; a stopped run resumed with ``load_state()`` passes over a torn folder and ends
bitwise equal to the run uninterrupted, in the foreground and with ``async_save``; ``load_state(url)`` loads a named one.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

pytest.importorskip("accelerate")

from acc_tiny import Counter, train  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from ckptio.accelerate import CkptioAccelerator  # noqa: E402


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    out = train(tmp_path_factory.mktemp("straight"), Accelerator)
    out.pop("main")
    return out


def _folders(store, prefix: str = "run") -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for key in store.keys(prefix + "/"):
        name, _, rest = key[len(prefix) + 1:].partition("/")
        out.setdefault(name, set()).add(rest)
    return out


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_saved_rotated_and_resumed_in_the_bucket_bitwise(store, tmp_path, straight, caplog, async_save):
    if store.scheme != "s3" and async_save:
        pytest.skip("the background path is the same on every store: s3 only")
    cls = functools.partial(CkptioAccelerator, ckptio_checkpoint_dir=store.url("run"), async_save=async_save)
    train(tmp_path / "first", cls, stop=7, limit=2)  # saves after steps 3 and 6
    assert not (tmp_path / "first" / "checkpoints").exists()
    folders = _folders(store)
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
    assert sorted(n for n in _folders(store) if n.startswith("checkpoint_")) == ["checkpoint_2", "checkpoint_3"]
    acc, counter = cls(cpu=True), Counter()  # a named folder of the bucket loads too
    acc.register_for_checkpointing(counter)
    assert acc.load_state(store.url("run/checkpoint_3")) == store.url("run/checkpoint_3")
    assert acc.project_configuration.iteration == 4 and counter.n == 12
    acc.end_training()
