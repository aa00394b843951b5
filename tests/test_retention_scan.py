"""Retention in a bucket looks at the folder in a few requests however many steps it keeps
(src/ckptio/storage/objstore/scanning.py), on a real S3, GCS and Azure server each (the ``store`` fixture): one
recursive listing of the folder, no manifest fetched again while the listing shows it unchanged, and a manifest
changed behind the manager's back is read again, never decided on from the old bytes."""

from __future__ import annotations

import collections

import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.engine.layout import BEST, pointer_target
from ckptio.engine.manifest import Manifest
from ckptio.storage import open_storage
from test_s3 import _counted

ASKED = ("listing", "head", "get", "read_into")


def _manager(url: str, **config) -> CheckpointManager:
    torch.manual_seed(0)
    return CheckpointManager(CheckpointConfig(checkpoint_dir=url, **config), model=torch.nn.Linear(8, 8), rng=False)


def _asked(mgr: CheckpointManager, steps: range, monkeypatch) -> collections.Counter:
    """The reads and listings rank 0 asked the bucket for while saving ``steps``, by kind (a manifest read apart)."""
    calls: list[tuple[str, str]] = []
    kind = type(mgr.storage.store)
    with monkeypatch.context() as patched:
        for name in ASKED:
            patched.setattr(kind, name, _counted(kind, name, calls))
        for step in steps:
            mgr.save(step=step)
    return collections.Counter("manifest" if key.endswith("/manifest.json") else name for name, key in calls)


def _few_then_many(mgr: CheckpointManager, monkeypatch) -> tuple[collections.Counter, collections.Counter]:
    """What saves 5-6 asked for (3 steps kept), then saves 21-22 (11 kept, with ``keep_every_n_steps=2``)."""
    for step in range(1, 5):
        mgr.save(step=step)
    few = _asked(mgr, range(5, 7), monkeypatch)
    for step in range(7, 21):
        mgr.save(step=step)
    return few, _asked(mgr, range(21, 23), monkeypatch)


def test_retention_asks_the_same_few_requests_however_many_steps_it_keeps(store, monkeypatch):
    """With ``keep_every_n_steps`` the kept steps grow with the run: each save listed every step and read every
    manifest twice (the scan, then what refers to what before a removal): 52 requests a save with 11 steps kept on
    GCS, 32 with 3. Now a save asks as much with 3 kept steps as with 11: the step's listing when it begins, one
    listing of the folder and the manifest it just wrote (20.5 requests in all on GCS)."""
    with _manager(store.url("grow"), keep_latest=2, keep_every_n_steps=2) as mgr:
        few, many = _few_then_many(mgr, monkeypatch)
    kept = [f for f in store.folders("grow") if f.startswith("epoch_")]
    assert len(kept) == 12, kept  # every second step, and the newest
    assert many == few, (few, many)
    assert many["listing"] <= 2 * 2 and many["manifest"] <= 2 and many["read_into"] == 0, many  # per save: 2
    # listings at most, 1 manifest, no other read (LATEST, pointed at the step just written, is not read back)


def test_what_latest_offers_to_share_is_read_in_the_same_few_requests_however_many_steps_are_kept(store, monkeypatch):
    """With frozen tensors (a fine-tune's base) each save first reads what ``LATEST`` offers to share, which counts
    the committed steps that use each file: every step's listing and manifest again, before every save (GCS: 33.5
    requests a save with 3 steps kept, 49.5 with 11). It goes through the same scan now."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[0].requires_grad_(False)
    config = CheckpointConfig(checkpoint_dir=store.url("frozen"), keep_latest=2, keep_every_n_steps=2)
    with CheckpointManager(config, model=model, rng=False) as mgr:
        few, many = _few_then_many(mgr, monkeypatch)
    assert many == few, (few, many)
    assert many["manifest"] <= 2 * 2, many


def test_a_manifest_rewritten_behind_the_manager_is_read_again(store):
    """A manifest is taken from memory only while the listing shows the same version of it (generation, ETag) and
    size: step 1's, rewritten in the bucket with a better loss and the same size, moves ``BEST`` at the next save."""
    url = store.url("best")
    with _manager(url, monitor="loss", mode="min") as mgr:
        for step, loss in ((1, 3.0), (2, 2.0), (3, 1.0)):
            mgr.save(step=step, metrics={"loss": loss})
        storage = open_storage(url)
        assert pointer_target(storage, BEST).name.endswith("_step_3")
        (one,) = [k for k in store.keys("best/") if "_step_1/" in k and k.endswith("/manifest.json")]
        old = store.get(one)
        manifest = Manifest.from_json(old, one)
        manifest.metrics = {"loss": 0.5}
        new = manifest.to_json().encode()
        assert len(new) == len(old) and new != old  # the version alone tells them apart
        store.put(one, new)
        mgr.save(step=4, metrics={"loss": 1.5})
        assert pointer_target(storage, BEST).name.endswith("_step_1"), "decided on step 1's old manifest"
        mgr.save(step=5, metrics={"loss": 0.25})
        assert pointer_target(storage, BEST).name.endswith("_step_5")


def test_a_folder_too_large_to_hold_is_listed_step_by_step_and_kept_right(store, monkeypatch):
    """Past :data:`~ckptio.storage.objstore.scanning.WHOLE_LIMIT` objects the folder's listing is not held (its
    memory would outgrow what it saves): retention lists step by step, as before, and keeps the right steps."""
    from ckptio.storage.objstore import scanning

    monkeypatch.setattr(scanning, "WHOLE_LIMIT", 3)
    with _manager(store.url("large"), keep_latest=2) as mgr:
        for step in range(1, 5):
            mgr.save(step=step)
        assert mgr.storage._memo.whole is False
        asked = _asked(mgr, range(5, 6), monkeypatch)
    assert asked["listing"] > 2, asked  # the folder, then a step at a time
    assert sorted(f for f in store.folders("large") if f.startswith("epoch_")) == \
        ["epoch_0_step_4", "epoch_0_step_5"]


def test_the_first_save_of_a_manager_sweeps_the_folder_in_one_listing(store, monkeypatch):
    """A manager's first save sweeps the folder for leftovers of interrupted saves: each step was listed on its own
    (a resumed run with hundreds of steps kept asked as many listings before its first save); one listing now."""
    url = store.url("sweep")
    with _manager(url) as mgr:
        for step in range(1, 13):
            mgr.save(step=step)
    with _manager(url) as again:
        asked = _asked(again, range(13, 14), monkeypatch)
    assert asked["listing"] <= 2, asked  # the folder, and the step begun
