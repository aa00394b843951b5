"""The frameworks' own folders (HF Trainer ``checkpoint-N``, accelerate ``checkpoint_N``) behind ckptio's one gate.

Proven here with the real Trainer and the real accelerate: retention ranks and counts complete checkpoints only
(a torn folder is neither counted nor deleted, the newest complete one and the one just written are never
deleted); every field of ``trainer_state.json`` the Trainer reads is checked for its type and nesting; an RNG
state is checked for its structure and ranges when its folder is checked, not when it is applied; a folder the
plain ``Accelerator`` wrote (no manifest) has its files read through ckptio's safe loaders before it is chosen. A
folder failing any check is skipped with its reason when an older complete one exists;
``NoUsableCheckpointError`` is raised when none does.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from acc_tiny import train as acc_train  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from hf_tiny import run_names, trainer  # noqa: E402
from transformers import Trainer  # noqa: E402

from ckptio import CheckpointCorruptError, NoUsableCheckpointError  # noqa: E402
from ckptio import accelerate as ck_acc  # noqa: E402
from ckptio.accelerate import CkptioAccelerator  # noqa: E402
from ckptio.hf_trainer import CkptioTrainer, last_checkpoint, usable_checkpoints  # noqa: E402


@pytest.fixture(scope="module")
def plain_hf(tmp_path_factory) -> Path:
    """The plain Trainer's folders (no manifest): checkpoint-4 and checkpoint-8."""
    root = tmp_path_factory.mktemp("plain_hf")
    trainer(Trainer, root, 8).train()
    return root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# ------------------------------------------------------------------------------------------------ row 1: retention
def test_trainer_retention_never_counts_a_torn_folder_nor_deletes_the_newest_complete(tmp_path):
    trainer(CkptioTrainer, tmp_path, 2, save_steps=2).train()
    torn = tmp_path / "checkpoint-8"  # a save cut short: no manifest, no optimizer.pt
    shutil.copytree(tmp_path / "checkpoint-2", torn, ignore=shutil.ignore_patterns("manifest.json", "optimizer.pt"))
    ours = trainer(CkptioTrainer, tmp_path, 4, save_steps=2, save_total_limit=1)
    ours.train(resume_from_checkpoint=True)  # resumes from checkpoint-2, saves checkpoint-4
    assert run_names(tmp_path) == ["checkpoint-4", "checkpoint-8"]  # the torn one left alone, not counted
    assert last_checkpoint(tmp_path).name == "checkpoint-4"
    # the next resume goes on from checkpoint-4
    again = trainer(CkptioTrainer, tmp_path, 6, save_steps=2, save_total_limit=1)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 6 and run_names(tmp_path) == ["checkpoint-6", "checkpoint-8"]


def test_the_end_of_training_keeps_the_best_and_the_newest_and_leaves_a_torn_folder(tmp_path):
    """save_total_limit=1 with a best (step 8 of 12): the plain Trainer ends deleting every folder but the best, the
    newest complete one and a torn one included; ckptio keeps the best and the newest, and leaves the torn one."""
    torn = tmp_path / "checkpoint-40"
    torn.mkdir(parents=True)
    (torn / "config.json").write_text("{}")
    ours = trainer(CkptioTrainer, tmp_path, 12, evaluate=True, save_total_limit=1, metric_for_best_model="score",
                   greater_is_better=True, load_best_model_at_end=True)
    ours.train()
    assert Path(ours.state.best_model_checkpoint).name == "checkpoint-8" and ours.args.save_total_limit == 1
    assert run_names(tmp_path) == ["checkpoint-8", "checkpoint-12", "checkpoint-40"]
    assert last_checkpoint(tmp_path).name == "checkpoint-12"


def test_accelerate_total_limit_never_counts_a_torn_folder(tmp_path):
    acc_train(tmp_path, CkptioAccelerator, stop=3, limit=1)  # checkpoint_0
    ckpts = tmp_path / "checkpoints"
    torn = ckpts / "checkpoint_5"  # a plain save cut short: no manifest, no random states
    torn.mkdir()
    shutil.copy(ckpts / "checkpoint_0" / "model.safetensors", torn / "model.safetensors")
    acc_train(tmp_path, CkptioAccelerator, stop=6, resume=True, limit=1)  # loads 0, saves checkpoint_1
    assert run_names(ckpts) == ["checkpoint_1", "checkpoint_5"]
    good, skipped = ck_acc.usable_checkpoints(ckpts)
    assert [p.name for p in good] == ["checkpoint_1"] and [n for n, _ in skipped] == ["checkpoint_5"]


def test_remove_oldest_ranks_only_complete_folders(tmp_path):
    import re

    from ckptio.errors import CheckpointCorruptError as Bad
    from ckptio.integrations.framework_dirs import remove_oldest

    for n in (1, 2, 3, 7, 9):
        (tmp_path / f"c-{n}").mkdir()
    torn = {"c-7", "c-9", "c-1"}

    def check(path: Path) -> None:
        if path.name in torn:
            raise Bad(f"{path}: torn")

    name = re.compile(r"^c-(\d+)$")
    assert remove_oldest(tmp_path, name, 1, check=check, saved="c-2") == []  # 2 complete: 2 (just saved) and 3
    assert run_names(tmp_path) == ["c-1", "c-2", "c-3", "c-7", "c-9"]
    assert [p.name for p in remove_oldest(tmp_path, name, 1, check=check, saved="c-3")] == ["c-2"]
    assert run_names(tmp_path) == ["c-1", "c-3", "c-7", "c-9"]


# ------------------------------------------------------------------------------- row 2: trainer_state.json fields
BAD_STATES = {
    "stateful_callbacks": {"stateful_callbacks": 5},
    "stateful_list": {"stateful_callbacks": {"TrainerControl": [3]}},
    "callback_args": {"stateful_callbacks": {"TrainerControl": {"args": [1], "attributes": {}}}},
    "callback_attribute": {"stateful_callbacks": {"TrainerControl": {"args": {}, "attributes": {"__class__": 1}}}},
    "log_history": {"log_history": [1, 2]},
    "best_model_checkpoint": {"best_model_checkpoint": 7},
    "train_batch_size": {"train_batch_size": None},
    "global_step_float": {"global_step": 8.0},
    "epoch": {"epoch": "two"},
    "unknown_key": {"surprise": 1},
}


def _bad_state(path: Path, bad: str) -> str:
    state = json.loads(path.read_text())
    if bad == "deep":
        return json.dumps(state)[:-1] + ', "trial_params": ' + "[" * 100_000 + "]" * 100_000 + "}"
    state.update(BAD_STATES[bad])
    return json.dumps(state)


@pytest.mark.parametrize("bad", ["deep", *BAD_STATES])
def test_a_trainer_state_of_the_wrong_shape_is_skipped_for_the_older_folder(tmp_path, plain_hf, bad, caplog):
    root = _copy(plain_hf, tmp_path / "out")
    text = _bad_state(root / "checkpoint-8" / "trainer_state.json", bad)
    (root / "checkpoint-8" / "trainer_state.json").write_text(text)
    good, skipped = usable_checkpoints(root)
    assert [p.name for p in good] == ["checkpoint-4"]
    assert [n for n, _ in skipped] == ["checkpoint-8"] and "trainer_state.json" in skipped[0][1], skipped
    assert last_checkpoint(root).name == "checkpoint-4"
    if bad in ("deep", "stateful_callbacks"):
        ours = trainer(CkptioTrainer, root, 8)
        ours.train(resume_from_checkpoint=True)  # from checkpoint-4
        assert ours.state.global_step == 8 and "skipping checkpoint-8" in caplog.text
        assert (root / "checkpoint-8" / "manifest.json").is_file()
        shutil.rmtree(root / "checkpoint-8")
    (root / "checkpoint-4" / "trainer_state.json").write_text(_bad_state(root / "checkpoint-4" / "trainer_state.json",
                                                                         bad))
    with pytest.raises(NoUsableCheckpointError, match="trainer_state.json"):
        trainer(CkptioTrainer, root, 8).train(resume_from_checkpoint=True)


@pytest.mark.parametrize("bad", ["deep", "version", "not_an_object"])
def test_the_model_configuration_the_trainer_reads_is_checked(tmp_path, plain_hf, bad):
    root = _copy(plain_hf, tmp_path / "out")
    config = root / "checkpoint-8" / "config.json"
    text = {"deep": '{"transformers_version": "5.0", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "version": json.dumps({**json.loads(config.read_text()), "transformers_version": 5}),
            "not_an_object": "[1, 2]"}[bad]
    config.write_text(text)
    good, skipped = usable_checkpoints(root)
    assert [p.name for p in good] == ["checkpoint-4"] and "config.json" in dict(skipped)["checkpoint-8"]
    with pytest.raises(CheckpointCorruptError, match="config.json"):
        trainer(CkptioTrainer, root, 12).train(resume_from_checkpoint=str(root / "checkpoint-8"))


def test_a_callback_state_that_does_not_fit_its_class_is_named(tmp_path, plain_hf):
    root = _copy(plain_hf, tmp_path / "out")
    path = root / "checkpoint-8" / "trainer_state.json"
    state = json.loads(path.read_text())
    state["stateful_callbacks"]["TrainerControl"]["args"]["no_such_argument"] = True
    path.write_text(json.dumps(state))
    with pytest.raises(CheckpointCorruptError, match="trainer_state.json.*TrainerControl"):
        trainer(CkptioTrainer, root, 12, restore_callback_states_from_checkpoint=True).train(resume_from_checkpoint=True)


# ------------------------------------------------------------------------------------------- row 3: the RNG state
def _rng_file(path: Path, python: tuple) -> None:
    torch.save({"python": python, "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}, path)


@pytest.mark.parametrize("bad", ["negative_word", "long_word", "bad_index", "short", "numpy"])
def test_a_bad_rng_state_is_refused_when_the_folder_is_checked(tmp_path, plain_hf, bad):
    root = tmp_path / "out"
    _copy(plain_hf, root)
    version, words, gauss = random.getstate()
    rng = root / "checkpoint-8" / "rng_state.pth"
    if bad == "numpy":
        torch.save({"python": random.getstate(), "numpy": ("MT19937", np.zeros(3, dtype=np.uint32), 0, 0, 0.0),
                    "cpu": torch.random.get_rng_state()}, rng)
    else:
        words = {"negative_word": (-1,) + words[1:], "long_word": (1 << 40,) + words[1:],
                 "bad_index": words[:-1] + (10_000,), "short": words[:10]}[bad]
        _rng_file(rng, (version, words, gauss))
    good, skipped = usable_checkpoints(root)
    assert [p.name for p in good] == ["checkpoint-4"] and "rng_state.pth" in dict(skipped)["checkpoint-8"]
    with pytest.raises(CheckpointCorruptError, match="rng_state.pth"):
        trainer(CkptioTrainer, root, 12).train(resume_from_checkpoint=str(root / "checkpoint-8"))


# --------------------------------------------------------------- row 4: the plain Accelerator's folder, read safely
class _Boom:
    def __reduce__(self):  # noqa: ANN204
        return (print, ("pwned",))


@pytest.fixture(scope="module")
def acc_straight(tmp_path_factory) -> dict:
    out = acc_train(tmp_path_factory.mktemp("acc_straight"), Accelerator)
    out.pop("main")
    return out


def test_a_damaged_file_in_the_plain_accelerators_newest_folder_falls_back(tmp_path, acc_straight, capsys):
    acc_train(tmp_path, Accelerator, stop=7)  # checkpoint_0 (step 3) and checkpoint_1 (step 6), no manifest
    ckpts = tmp_path / "checkpoints"
    opt = ckpts / "checkpoint_1" / "optimizer.bin"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])  # truncated
    good, skipped = ck_acc.usable_checkpoints(ckpts)
    assert [p.name for p in good] == ["checkpoint_0"] and "optimizer.bin" in dict(skipped)["checkpoint_1"]
    out = acc_train(tmp_path, CkptioAccelerator, resume=True)  # from checkpoint_0, to the end
    out.pop("main")
    for k in acc_straight:
        assert torch.equal(out[k], acc_straight[k]), k
    # a planted pickle in the only other folder: nothing usable, each file named
    shutil.rmtree(ckpts)
    acc_train(tmp_path, Accelerator, stop=7)
    opt.write_bytes(opt.read_bytes()[:100])
    (ckpts / "checkpoint_0" / "optimizer.bin").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(NoUsableCheckpointError, match="optimizer.bin"):
        acc_train(tmp_path, CkptioAccelerator, resume=True)
    assert "pwned" not in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["model", "scheduler", "custom", "random"])
def test_each_file_of_a_plain_accelerate_folder_is_checked(tmp_path, bad):
    acc_train(tmp_path, Accelerator, stop=7)
    ckpts = tmp_path / "checkpoints"
    name = {"model": "model.safetensors", "scheduler": "scheduler.bin", "custom": "custom_checkpoint_0.pkl",
            "random": "random_states_0.pkl"}[bad]
    target = ckpts / "checkpoint_1" / name
    if bad == "random":
        state = torch.load(target, weights_only=False)
        version, words, gauss = state["random_state"]
        state["random_state"] = (version, (-5,) + words[1:], gauss)
        torch.save(state, target)
    else:
        target.write_bytes(target.read_bytes()[:-7])
    good, skipped = ck_acc.usable_checkpoints(ckpts)
    assert [p.name for p in good] == ["checkpoint_0"] and name in dict(skipped)["checkpoint_1"]
