"""``CkptioTrainer(..., ckptio_checkpoint_dir="s3://bucket/run")``: the Trainer's ``checkpoint-N`` folders in object
storage (``gs://``, ``az://`` alike), against real loopback servers (moto, fake-gcs-server, Azurite) and the real
transformers Trainer.

Proven here: the checkpoints are committed steps in the bucket (manifest last) and none is left in the local
``output_dir``; ``save_total_limit`` rotates them there (saved in the foreground and with ``async_save``);
``resume_from_checkpoint=True`` passes over a torn and a
damaged folder and ends bitwise equal to the run uninterrupted; the best model is kept and reloaded at the end as the
Trainer does locally; a named checkpoint URL resumes.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from distributed import launch  # noqa: E402
from hf_tiny import Tokens, arguments, model, run_names, same_tensors, state, trainer  # noqa: E402
from transformers import Trainer  # noqa: E402

from ckptio.errors import ConfigError  # noqa: E402
from ckptio.hf_trainer import CkptioTrainer  # noqa: E402

STEPS = 16
RUNNER = str(Path(__file__).resolve().parent / "hf_run.py")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    tr = trainer(Trainer, tmp_path_factory.mktemp("straight"), STEPS)
    tr.train()
    return state(tr)


# Azurite answers a request in ~15 ms: 10 s there, marked slow
@pytest.mark.parametrize("store", ["s3", "gs", pytest.param("az", marks=pytest.mark.slow)], indirect=True)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_checkpoints_are_committed_in_the_bucket_rotated_there_and_resumed_bitwise(store, tmp_path, straight,
                                                                                   caplog, async_save):
    if store.scheme != "s3" and async_save:
        pytest.skip("the background path is the same on every store: s3 only")
    ours = functools.partial(CkptioTrainer, ckptio_checkpoint_dir=store.url("run"), async_save=async_save)
    first = trainer(ours, tmp_path / "out", 12, save_total_limit=2)
    first.train()
    assert not [n for n in run_names(tmp_path / "out") if n.startswith(("checkpoint-", ".checkpoint-"))]
    folders = store.folders()
    assert sorted(n for n in folders if n.startswith("checkpoint-")) == ["checkpoint-12", "checkpoint-8"]
    assert ".ckptio_record.json" in folders  # the run's record beside its checkpoints
    manifest = json.loads(store.get("run/checkpoint-12/manifest.json"))
    assert {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json"} <= set(manifest["files"]) == set(manifest["checksums"]) == \
        folders["checkpoint-12"] - {"manifest.json"}
    assert manifest["step"] == 12 and manifest["states"]["model"]["path"] == "model.safetensors"
    # checkpoint-12 damaged (one bit of its optimizer state), checkpoint-16 torn (a save cut short: no manifest)
    data = bytearray(store.get("run/checkpoint-12/optimizer.pt"))
    data[len(data) // 2] ^= 0x01
    store.put("run/checkpoint-12/optimizer.pt", bytes(data))
    for rel in folders["checkpoint-8"] - {"manifest.json"}:
        store.put(f"run/checkpoint-16/{rel}", store.get(f"run/checkpoint-8/{rel}"))
    resumed = trainer(ours, tmp_path / "out2", STEPS, save_total_limit=2)
    resumed.train(resume_from_checkpoint=True)
    same_tensors(state(resumed), straight, "resumed from checkpoint-8 in the bucket")
    assert "skipping checkpoint-16" in caplog.text and "skipping checkpoint-12" in caplog.text
    assert sorted(n for n in store.folders() if n.startswith("checkpoint-")) == ["checkpoint-12", "checkpoint-16"]
    # a named checkpoint URL resumes too
    named = trainer(ours, tmp_path / "out3", STEPS)
    named.train(resume_from_checkpoint=store.url("run/checkpoint-12"))
    same_tensors(state(named), straight, "resumed from the URL of checkpoint-12")


def test_the_best_model_is_kept_in_the_bucket_and_reloaded_as_the_trainer_does_locally(bucket, tmp_path):
    """save_total_limit=1 with load_best_model_at_end on a metric whose best is not the latest (as
    tests/test_hf_trainer.py does locally): the same checkpoints kept, the same best model loaded at the end."""
    ends = {}
    kw = dict(evaluate=True, save_total_limit=1, metric_for_best_model="score", greater_is_better=True,
              load_best_model_at_end=True)
    for name, cls in (("local", CkptioTrainer),
                      ("bucket", functools.partial(CkptioTrainer, ckptio_checkpoint_dir=f"s3://{bucket}/run"))):
        tr = trainer(cls, tmp_path / name, 12, **kw)
        tr.train()
        ends[name] = (tr.state.best_model_checkpoint.rpartition("/")[2], tr.state.best_metric,
                      {k: v.clone() for k, v in tr.model.state_dict().items()})
    assert ends["bucket"][:2] == ends["local"][:2] == ("checkpoint-8", 0.9)
    same_tensors(ends["bucket"][2], ends["local"][2], "the best model loaded at the end")
    kept = [n for n in run_names(tmp_path / "local") if n.startswith("checkpoint-")]
    from conftest import Store

    assert sorted(n for n in Store("s3", bucket).folders() if n.startswith("checkpoint-")) == sorted(kept)


def test_each_hyperparameter_search_trial_keeps_its_checkpoints_under_its_own_prefix(bucket, tmp_path):
    """``Trainer.hyperparameter_search`` with the real optuna backend, 2 trials: as locally (``output_dir/run-N``),
    each trial's checkpoints are committed under ``url/run-N`` with its own record and its own rotation
    (``save_total_limit=1``), its lease released; nothing of a trial lands beside another's."""
    optuna = pytest.importorskip("optuna")
    from conftest import Store

    rates = {}

    def space(trial):  # noqa: ANN001, ANN202
        rates[trial.number] = trial.suggest_float("learning_rate", 1e-3, 1e-2)
        return {"learning_rate": rates[trial.number]}

    tr = CkptioTrainer(model_init=model, args=arguments(tmp_path / "out", 4, save_steps=2, save_total_limit=1),
                       train_dataset=Tokens(), eval_dataset=Tokens(8, seed=4),
                       ckptio_checkpoint_dir=f"s3://{bucket}/run")
    tr.hyperparameter_search(hp_space=space, n_trials=2, direction="minimize", backend="optuna",
                             sampler=optuna.samplers.RandomSampler(seed=0))
    assert tr.ckptio_run.url == f"s3://{bucket}/run"  # the search over, the trainer's run is the url's again
    store = Store("s3", bucket)
    assert sorted(store.folders()) == ["run-0", "run-1"]  # nothing directly under the url, no lease left
    for number, rate in rates.items():
        folders = store.folders(f"run/run-{number}")
        assert sorted(folders) == [".ckptio_record.json", "checkpoint-4"], folders
        saved = json.loads(store.get(f"run/run-{number}/checkpoint-4/trainer_state.json"))
        assert saved["trial_params"] == {"learning_rate": rate}  # this trial's own checkpoint
        assert "manifest.json" in folders["checkpoint-4"]
    assert len(set(rates.values())) == 2


def test_a_location_that_is_no_object_store_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"ckptio_checkpoint_dir='hdfs://b/run'.*output_dir"):
        CkptioTrainer(model=model(), args=arguments(tmp_path, 4), train_dataset=Tokens(),
                      ckptio_checkpoint_dir="hdfs://b/run")
    assert not list(Path(tmp_path).iterdir())


def _run(*args: str, ok: bool = True) -> None:
    done = launch(RUNNER, *args, ranks=2)
    text = done.stdout + done.stderr
    assert (done.returncode == 0) == ok, text[-4000:]


@pytest.mark.slow
def test_two_ranks_killed_before_a_commit_then_resumed_from_the_bucket_end_bitwise_equal(bucket, tmp_path):
    """2 DDP ranks (torchrun) save into the bucket, each uploading its own RNG file; rank 0 is SIGKILLed before the
    manifest of its second save (checkpoint-8 uploaded, not committed, its lease left behind); the rerun takes the
    lease over, resumes from checkpoint-4 and ends bitwise equal to the plain Trainer's uninterrupted 2-rank run."""
    from conftest import Store

    _run(str(tmp_path / "plain"), str(STEPS), str(tmp_path / "straight.pt"), "--plain")
    url = f"s3://{bucket}/run"
    _run(str(tmp_path / "a"), str(STEPS), str(tmp_path / "x.pt"), "--bucket", url, "--kill-at",
         "commit.before_manifest:2", ok=False)
    folders = Store("s3", bucket).folders()
    assert "manifest.json" in folders["checkpoint-4"] and "manifest.json" not in folders["checkpoint-8"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= folders["checkpoint-8"]
    _run(str(tmp_path / "b"), str(STEPS), str(tmp_path / "resumed.pt"), "--bucket", url, "--resume")
    same_tensors(torch.load(tmp_path / "resumed.pt", weights_only=True),
          torch.load(tmp_path / "straight.pt", weights_only=True), "2 ranks, killed before a commit -> resumed")
    folders = Store("s3", bucket).folders()
    assert all("manifest.json" in folders[f"checkpoint-{s}"] for s in (4, 8, 12, 16))
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(json.loads(
        Store("s3", bucket).get("run/checkpoint-16/manifest.json"))["files"])
