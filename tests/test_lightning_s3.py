"""The Lightning plugin with ``ModelCheckpoint(dirpath="s3://bucket/prefix")``, against a real S3-compatible server.

An object store has no rename: a ``last.ckpt`` that is saved again is written complete under a hidden name and
swapped in (``ckptio.storage.objstore.replace``). Proven here, with the real Lightning and boto3 against moto's server:
top-k and last keep the names Lightning keeps locally; a run stopped and resumed with ``ckpt_path="last"`` ends
bitwise equal to the run uninterrupted; a run SIGKILLed while ``last.ckpt`` is being swapped (old one no longer
committed, new one complete beside it) resumes from the new one, and the next save finishes the swap; a run
killed while writing the hidden copy keeps the old ``last.ckpt``; Lightning's own ``.ckpt`` object resumes.
The same on ``gs://`` and ``az://`` (fake-gcs-server, Azurite): Lightning looks at the folder through ckptio's fsspec
filesystem over its own clients (:mod:`ckptio.storage.objstore.fsspec_fs`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")
pytest.importorskip("boto3")
pytest.importorskip("moto")

from distributed import launch  # noqa: E402
from lit_tiny import fit, same  # noqa: E402

from ckptio.lightning import CkptioCheckpointIO, last_checkpoint, read_checkpoint  # noqa: E402
from ckptio.storage import s3 as s3mod  # noqa: E402

EPOCHS = 4
ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(ROOT / "tests" / "lit_run.py")


def _top(bucket: str, prefix: str = "run") -> dict[str, set[str]]:
    """name directly under ``prefix`` -> the objects below it."""
    out: dict[str, set[str]] = {}
    for page in s3mod.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            name, _, rest = obj["Key"][len(prefix) + 1:].partition("/")
            out.setdefault(name, set()).add(rest)
    return out


def test_a_path_of_no_object_store_is_refused_by_the_plugin_never_written_as_a_local_folder(tmp_path, monkeypatch):
    """The plugin writes to a local folder or object storage only: an hdfs:// path (pathlib would read it as the
    relative folder 'hdfs:/…') is refused by name, and nothing appears on the local disk."""
    from ckptio.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"hdfs://b/run/epoch=0\.ckpt.*hdfs:// is not supported"):
        CkptioCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "global_step": 1},
                                             "hdfs://b/run/epoch=0.ckpt")
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    return fit(str(tmp_path_factory.mktemp("straight")), EPOCHS)


def test_top_k_last_and_resume_in_a_bucket(bucket, tmp_path, straight):
    local = tmp_path / "local"
    options = dict(monitor="train_loss", mode="min", save_top_k=2, save_last=True, every_n_epochs=None,
                   every_n_train_steps=3)
    fit(str(local), EPOCHS, **options)
    fit(f"s3://{bucket}/top", EPOCHS, [CkptioCheckpointIO()], **options)
    top = _top(bucket, "top")
    assert sorted(top) == sorted(p.name for p in local.iterdir()), (sorted(top), sorted(local.iterdir()))
    assert all("manifest.json" in files for files in top.values())

    url = f"s3://{bucket}/run"
    fit(url, 2, [CkptioCheckpointIO()], save_last=True)
    assert last_checkpoint(url) == f"{url}/last.ckpt"
    resumed = fit(url, EPOCHS, [CkptioCheckpointIO()], ckpt_path=last_checkpoint(url), save_last=True)
    same(resumed, straight, "s3: stopped, resumed from last")
    assert read_checkpoint(f"{url}/last.ckpt")["global_step"] == 8 * EPOCHS
    assert sorted(_top(bucket)) == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "epoch=2-step=24.ckpt",
                                    "epoch=3-step=32.ckpt", "last.ckpt"]
    # background saves to the bucket
    url = f"s3://{bucket}/async"
    fit(url, 2, [CkptioCheckpointIO(async_save=True)], save_last=True)
    resumed = fit(url, EPOCHS, [CkptioCheckpointIO(async_save=True)], ckpt_path=last_checkpoint(url), save_last=True)
    same(resumed, straight, "s3, background saves: stopped, resumed from last")


def _run(*args: str, ok: bool = True) -> None:
    done = launch(RUNNER, *args)
    if ok:
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    else:
        assert not Path(args[2]).exists(), f"{args}: the run was meant to stop early and did not"


@pytest.mark.slow
@pytest.mark.parametrize("point", ["s3.swap.uncommitted", "s3.swap.copied", "commit.before_manifest"])
def test_killed_while_last_is_replaced_resumes_and_ends_bitwise_equal(bucket, tmp_path, straight, point):
    """SIGKILL in the second save of a rerun (``last.ckpt`` already there): inside the swap the old one is no
    longer committed and the new one is complete beside it; before the swap the old one is whole. Either way the
    next run resumes from a complete ``last.ckpt`` and ends bitwise equal; its first save clears what was left."""
    url = f"s3://{bucket}/run"
    _run(url, "1", str(tmp_path / "a.pt"))  # epoch 0: last.ckpt at step 8
    # the rerun's first save writes epoch=1-step=16.ckpt (a new name: written in place), then replaces last.ckpt
    _run(url, "3", str(tmp_path / "x.pt"), "--resume", "--kill-at", f"{point}:{2 if 'manifest' in point else 1}",
         ok=False)
    hidden = [n for n in _top(bucket) if n.startswith(".last.ckpt.tmp-")]
    assert len(hidden) == 1, _top(bucket)
    step = read_checkpoint(f"{url}/last.ckpt")["global_step"]
    assert step == (8 if point == "commit.before_manifest" else 16)  # the old one whole / the new copy
    assert last_checkpoint(url) == f"{url}/last.ckpt"  # listed and found, not taken for a save in progress
    _run(url, str(EPOCHS), str(tmp_path / "resumed.pt"), "--resume")
    same(torch.load(tmp_path / "resumed.pt", weights_only=True), straight, f"s3: killed at {point}, resumed")
    assert not [n for n in _top(bucket) if n.startswith(".")], _top(bucket)


@pytest.mark.parametrize("store", ["gs", "az"], indirect=True)
def test_stopped_and_resumed_from_last_on_gcs_and_azure(store, tmp_path, straight):
    """``ModelCheckpoint(dirpath="gs://…")`` (``az://``): Lightning lists and times the folder through fsspec (ckptio's
    filesystem over its own client: no gcsfs or adlfs here), the plugin writes and replaces the folders; a run
    stopped and resumed from ``last`` ends bitwise equal, and Lightning's own ``.ckpt`` object resumes too."""
    url = store.url("run")
    fit(url, 2, [CkptioCheckpointIO()], save_last=True)
    assert last_checkpoint(url) == f"{url}/last.ckpt"
    resumed = fit(url, EPOCHS, [CkptioCheckpointIO()], ckpt_path=last_checkpoint(url), save_last=True)
    same(resumed, straight, f"{store.scheme}: stopped, resumed from last")
    assert read_checkpoint(f"{url}/last.ckpt")["global_step"] == 8 * EPOCHS
    names = {key[len("run/"):].split("/")[0] for key in store.keys("run/")}
    assert sorted(names) == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "epoch=2-step=24.ckpt",
                             "epoch=3-step=32.ckpt", "last.ckpt"], sorted(names)
    fit(str(tmp_path), 2, save_last=True)  # Lightning's own .ckpt file, then put in the bucket
    store.put("theirs/last.ckpt", (tmp_path / "last.ckpt").read_bytes())
    resumed = fit(store.url("again"), EPOCHS, [CkptioCheckpointIO()], ckpt_path=store.url("theirs/last.ckpt"))
    same(resumed, straight, f"Lightning .ckpt in {store.scheme}:// -> ckptio")


def test_lightnings_own_ckpt_object_resumes(bucket, tmp_path, straight):
    fit(str(tmp_path), 2, save_last=True)  # Lightning's own .ckpt file, then put in the bucket
    s3mod.client().upload_file(str(tmp_path / "last.ckpt"), bucket, "theirs/last.ckpt")
    resumed = fit(f"s3://{bucket}/run", EPOCHS, [CkptioCheckpointIO()], ckpt_path=f"s3://{bucket}/theirs/last.ckpt")
    same(resumed, straight, "Lightning .ckpt in a bucket -> ckptio")


def test_load_from_checkpoint_reads_a_folder_in_a_bucket(bucket, tmp_path):
    """``LitModel.load_from_checkpoint(best_model_path)`` on a checkpoint in a bucket: read by ckptio, checksums
    checked, the weights the fit ended with and the hyper-parameters."""
    from lit_tiny import Tiny, loader, trainer

    url = f"s3://{bucket}/best"
    torch.manual_seed(0)
    module = Tiny(width=8)
    tr = trainer(url, 1, [CkptioCheckpointIO()], every_n_epochs=1, save_top_k=-1)
    tr.fit(module, loader(width=8))
    best = tr.checkpoint_callback.best_model_path
    assert best.startswith(url) and "manifest.json" in _top(bucket, "best")[best.rsplit("/", 1)[1]]
    loaded = Tiny.load_from_checkpoint(best)
    assert loaded.hparams.width == 8
    same(dict(loaded.state_dict()), dict(module.state_dict()), "load_from_checkpoint from a bucket")
