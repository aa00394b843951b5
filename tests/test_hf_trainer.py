"""The Hugging Face Trainer checkpointing through ckptio (``CkptioTrainer``), with the real transformers Trainer.

What a user changes is the class: ``CkptioTrainer(...)`` for ``Trainer(...)``. Proven here: a checkpoint keeps the
Trainer's layout (``from_pretrained`` loads it, the plain Trainer resumes from it) and is a committed folder with a
manifest; ``resume_from_checkpoint=True`` takes the newest *complete* checkpoint and ends bitwise equal to the run
uninterrupted, also after SIGTERM and a SIGKILL mid-save, on 1 and 2 ranks; the plain Trainer's own folders resume
under ckptio; retention keeps what the Trainer keeps; damaged, torn and hostile folders are refused naming why.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from distributed import launch  # noqa: E402
from hf_tiny import model, run_names, same_tensors, state, trainer  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer  # noqa: E402

from ckptio import CheckpointCorruptError, NoUsableCheckpointError  # noqa: E402
from ckptio.hf_trainer import CkptioTrainer, last_checkpoint, usable_checkpoints  # noqa: E402
from ckptio.goodput.record import RECORD_NAME as RECORD  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(ROOT / "tests" / "hf_run.py")
STEPS = 16


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    tr = trainer(Trainer, tmp_path_factory.mktemp("straight"), STEPS)
    tr.train()
    return state(tr)


def test_a_checkpoint_is_the_trainers_layout_committed_and_loadable(tmp_path, straight):
    ours = trainer(CkptioTrainer, tmp_path, 8)
    ours.train()
    assert run_names(tmp_path) == ["checkpoint-4", "checkpoint-8"]
    step = tmp_path / "checkpoint-8"
    manifest = json.loads((step / "manifest.json").read_text())
    assert {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json"} <= set(manifest["files"]) == set(manifest["checksums"])
    assert manifest["step"] == 8 and manifest["states"]["model"]["path"] == "model.safetensors"
    loaded = AutoModelForCausalLM.from_pretrained(step)
    same_tensors({k: v for k, v in loaded.state_dict().items()}, ours.model.state_dict(), "from_pretrained(checkpoint-8)")
    # the plain Trainer resumes from ckptio's folder (the manifest is one more file to it), bitwise
    plain = trainer(Trainer, tmp_path, STEPS)
    plain.train(resume_from_checkpoint=str(step))
    same_tensors(state(plain), straight, "ckptio checkpoint -> plain Trainer")


def test_the_trainers_own_checkpoints_resume_under_ckptio(tmp_path, straight):
    trainer(Trainer, tmp_path, 8).train()
    assert not (tmp_path / "checkpoint-8" / "manifest.json").exists()
    ours = trainer(CkptioTrainer, tmp_path, STEPS)
    ours.train(resume_from_checkpoint=True)
    same_tensors(state(ours), straight, "plain Trainer checkpoint -> ckptio")
    assert (tmp_path / "checkpoint-16" / "manifest.json").is_file()


def test_resume_true_takes_the_newest_complete_checkpoint(tmp_path, straight, caplog):
    trainer(CkptioTrainer, tmp_path, 12).train()
    shard = tmp_path / "checkpoint-12" / "optimizer.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: only the checksum sees it
    shard.write_bytes(bytes(data))
    torn = tmp_path / "checkpoint-16"  # a plain Trainer save cut short: no trainer_state.json yet
    shutil.copytree(tmp_path / "checkpoint-8", torn, ignore=shutil.ignore_patterns("trainer_state.json", "manifest*"))
    (tmp_path / "checkpoint-20").symlink_to(tmp_path / "checkpoint-8")
    good, skipped = usable_checkpoints(tmp_path)
    assert [p.name for p in good] == ["checkpoint-8", "checkpoint-4"]
    why = dict(skipped)
    assert "optimizer.pt" in why["checkpoint-12"] and "trainer_state.json" in why["checkpoint-16"]
    assert "link" in why["checkpoint-20"]
    ours = trainer(CkptioTrainer, tmp_path, STEPS)
    ours.train(resume_from_checkpoint=True)
    same_tensors(state(ours), straight, "resumed past a damaged, a torn and a linked checkpoint")
    assert "skipping checkpoint-12" in caplog.text


def test_nothing_usable_is_refused_and_an_empty_folder_starts_fresh(tmp_path):
    assert last_checkpoint(tmp_path) is None
    ours = trainer(CkptioTrainer, tmp_path, 4)
    ours.train(resume_from_checkpoint=True)  # the plain Trainer raises here; ckptio starts the run
    assert ours.state.global_step == 4
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{")
    with pytest.raises(NoUsableCheckpointError, match="checkpoint-4"):
        trainer(CkptioTrainer, tmp_path, 8).train(resume_from_checkpoint=True)


class _Boom:
    def __reduce__(self):  # noqa: ANN204
        return (print, ("pwned",))


def test_hostile_and_incomplete_files_of_a_trainer_checkpoint_are_refused(tmp_path, capsys):
    trainer(Trainer, tmp_path, 4).train()
    step = tmp_path / "checkpoint-4"
    good_rng = (step / "rng_state.pth").read_bytes()
    good_optimizer = torch.load(step / "optimizer.pt", weights_only=True)
    torch.save({"python": _Boom(), "numpy": 0, "cpu": torch.zeros(1, dtype=torch.uint8)}, step / "rng_state.pth")
    with pytest.raises(CheckpointCorruptError, match="rng_state.pth"):
        trainer(CkptioTrainer, tmp_path, 8).train(resume_from_checkpoint=str(step))
    assert "pwned" not in capsys.readouterr().out
    (step / "rng_state.pth").write_bytes(good_rng)
    (step / "optimizer.pt").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointCorruptError, match="optimizer.pt"):
        trainer(CkptioTrainer, tmp_path, 8).train(resume_from_checkpoint=str(step))
    (step / "optimizer.pt").unlink()
    (step / "optimizer.pt").symlink_to(tmp_path / "elsewhere.pt")  # the Trainer's readers would follow it
    torch.save(good_optimizer, tmp_path / "elsewhere.pt")
    with pytest.raises(CheckpointCorruptError, match="a link or special file"):
        trainer(CkptioTrainer, tmp_path, 8).train(resume_from_checkpoint=str(step))
    (step / "optimizer.pt").unlink()  # the plain Trainer would restart the optimizer silently
    with pytest.raises(CheckpointCorruptError, match="no optimizer.pt"):
        trainer(CkptioTrainer, tmp_path, 8).train(resume_from_checkpoint=str(step))
    assert "pwned" not in capsys.readouterr().out


@pytest.mark.parametrize("limit", [1, 2])
def test_the_checkpoints_kept_are_the_ones_the_trainer_keeps(tmp_path, limit):
    """save_total_limit, metric_for_best_model/greater_is_better and load_best_model_at_end, on a metric whose
    best (evaluation 2 of 4 at step 8, then 6 at step 24) is not the latest."""
    ends = {}
    for name, cls in (("plain", Trainer), ("ckptio", CkptioTrainer)):
        tr = trainer(cls, tmp_path / name, 24, evaluate=True, save_total_limit=limit, metric_for_best_model="score",
                     greater_is_better=True, load_best_model_at_end=True)
        tr.train()
        ends[name] = (run_names(tmp_path / name), Path(tr.state.best_model_checkpoint).name, tr.state.best_metric,
                      {k: v.clone() for k, v in tr.model.state_dict().items()})
    assert ends["ckptio"][:3] == ends["plain"][:3], (ends["ckptio"][:3], ends["plain"][:3])
    assert ends["ckptio"][1] == "checkpoint-24" and ends["ckptio"][2] == 0.95
    same_tensors(ends["ckptio"][3], ends["plain"][3], "the best model loaded at the end")
    kept = json.loads((tmp_path / "ckptio" / "checkpoint-24" / "manifest.json").read_text())
    assert kept["metrics"] == {"eval_score": 0.95}


# ---------------------------------------------------------------------- preemption and kills, 1 and 2 ranks
def _run(*args: str, ranks: int = 1, ok: bool = True) -> str:
    done = launch(RUNNER, *args, ranks=ranks)
    text = done.stdout + done.stderr
    if ok:
        assert done.returncode == 0, text[-4000:]
    else:
        assert done.returncode != 0 and not Path(args[2]).exists(), f"{args}: meant to stop early"
    return text


def _preempt_kill_resume(root: Path, ranks: int) -> dict:
    """SIGTERM after step 6 (checkpoint-4 is the newest), then a rerun SIGKILLed while its second save
    (checkpoint-12) is written and not yet in place, then a rerun to the end."""
    _run(str(root), str(STEPS), str(root / "x.pt"), "--sigterm-at", "6", ranks=ranks, ok=False)
    assert run_names(root) == ["checkpoint-4"]
    _run(str(root), str(STEPS), str(root / "y.pt"), "--resume", "--kill-at", "commit.before_rename:2", ranks=ranks,
         ok=False)
    names = run_names(root)
    assert names[:2] == ["checkpoint-4", "checkpoint-8"] and names[2].startswith(".checkpoint-12.tmp-"), names
    _run(str(root), str(STEPS), str(root / "resumed.pt"), "--resume", ranks=ranks)
    assert run_names(root) == ["checkpoint-4", "checkpoint-8", "checkpoint-12", "checkpoint-16"]
    assert not list(root.glob(f".{RECORD}.*.tmp")), "a killed write of the record was not swept by the next run"
    return torch.load(root / "resumed.pt", weights_only=True)


@pytest.mark.slow
def test_preempted_and_killed_mid_save_then_resumed_ends_bitwise_equal(tmp_path, straight):
    same_tensors(_preempt_kill_resume(tmp_path, 1), straight, "1 rank, SIGTERM + SIGKILL -> resume")


@pytest.mark.slow
def test_two_ranks_preempted_killed_resumed_adopted_and_resumed_on_one(tmp_path):
    _run(str(tmp_path / "plain"), str(STEPS), str(tmp_path / "straight.pt"), "--plain", ranks=2)
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    same_tensors(_preempt_kill_resume(tmp_path / "ours", 2), straight, "2 ranks, SIGTERM + SIGKILL -> resume")
    # the plain Trainer's 2-rank folders (rng_state_0/1.pth) resume under ckptio on 2 ranks
    for name in ("checkpoint-12", "checkpoint-16"):
        shutil.rmtree(tmp_path / "plain" / name)
    _run(str(tmp_path / "plain"), str(STEPS), str(tmp_path / "adopted.pt"), "--resume", ranks=2)
    same_tensors(torch.load(tmp_path / "adopted.pt", weights_only=True), straight, "2 ranks, plain Trainer -> ckptio")
    # another number of ranks: the 2-rank checkpoint-16 goes on on 1 rank (its RNG files are per rank)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ours" / "checkpoint-16").state_dict()
    one = trainer(CkptioTrainer, tmp_path / "ours", 20)
    seen = {}
    one.add_callback(_Peek(seen))
    one.train(resume_from_checkpoint=True)
    same_tensors(seen["weights"], saved, "2 ranks -> 1 rank, restored weights")
    assert one.state.global_step == 20 and (tmp_path / "ours" / "checkpoint-20" / "manifest.json").is_file()


class _Peek(__import__("transformers").TrainerCallback):
    def __init__(self, seen: dict) -> None:
        self.seen = seen

    def on_step_begin(self, args, state, control, model=None, **kw) -> None:  # noqa: ANN001
        self.seen.setdefault("weights", {k: v.detach().clone() for k, v in model.state_dict().items()})


def test_the_example_trains_and_resumes(tmp_path):
    script = ROOT / "examples" / "hf_trainer" / "train.py"
    for steps in (10, 20):
        done = launch(str(script), "--dir", str(tmp_path), "--steps", str(steps), timeout=300)
        assert done.returncode == 0 and f"trained to step {steps}" in done.stdout, done.stderr[-2000:]
    assert run_names(tmp_path) == ["checkpoint-15", "checkpoint-20"]  # save_total_limit=2
    assert (tmp_path / "checkpoint-20" / "manifest.json").is_file()


def test_a_folder_whose_name_disagrees_with_its_step_is_never_resumed_from_nor_outranks_progress(tmp_path, straight,
                                                                                                 caplog):
    """Issue 46, row 6: ``checkpoint-10`` holding a copy of ``checkpoint-4`` was taken by
    ``resume_from_checkpoint=True``, kept by ``save_total_limit=2`` while the real progress was deleted, and every
    later resume went back to step 4. The folder is named as what it is and left out of both."""
    trainer(CkptioTrainer, tmp_path, 8).train()
    shutil.copytree(tmp_path / "checkpoint-4", tmp_path / "checkpoint-10")
    good, skipped = usable_checkpoints(tmp_path)
    assert [p.name for p in good] == ["checkpoint-8", "checkpoint-4"]
    why = dict(skipped)["checkpoint-10"]
    assert "named for step 10" in why and "records step 4" in why, why
    ours = trainer(CkptioTrainer, tmp_path, STEPS, save_total_limit=2)
    ours.train(resume_from_checkpoint=True)
    same_tensors(state(ours), straight, "resumed from checkpoint-8 past a misnamed copy of checkpoint-4")
    assert "skipping checkpoint-10" in caplog.text and "records step 4" in caplog.text
    # retention counted the real folders only: the misnamed copy is left alone, the newest two real ones are kept
    assert run_names(tmp_path) == ["checkpoint-10", "checkpoint-12", "checkpoint-16"]


def test_a_resume_says_which_checkpoint_it_loaded(tmp_path, caplog):
    """Issue 52, row 8: the plain manager says what it loaded; CkptioTrainer said nothing."""
    trainer(CkptioTrainer, tmp_path, 8).train()
    with caplog.at_level("INFO", logger="ckptio"):
        trainer(CkptioTrainer, tmp_path, 12).train(resume_from_checkpoint=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Loaded checkpoint")]
    assert lines == [f"Loaded checkpoint {tmp_path / 'checkpoint-8'} (step 8, epoch {lines[0].split('epoch ')[1][:4]}, "
                     "saved on 1 rank(s), every byte read checksummed)"], lines
