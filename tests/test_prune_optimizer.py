"""``keep_optimizer_latest``: the optimizer state is kept in the newest checkpoints only (issue 47, its "optimizer
state where it is used" part). Proven with real saves, real processes killed (SIGKILL) between the manifest's
replacement and the removal of the files, the real ``ckptio`` commands and a real S3 server: older kept
checkpoints keep their weights (bitwise), verify, consolidate and list as weights-only; a full resume from one is
refused saying what was pruned and how to load the rest; a kill leaves garbage at worst, collected by the next
save; a manifest whose pruned folders overlap what it keeps is refused."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager, CheckpointMismatchError
from ckptio.cli import main
from ckptio.engine.manifest import MANIFEST_NAME, read_manifest

sys.path.insert(0, str(Path(__file__).parent))
from forked_scripts import run_script  # noqa: E402


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(root: str, steps: range, **config: object) -> dict[int, dict[str, torch.Tensor]]:
    """Train and save at every step of ``steps`` (a loss as metric); the weights saved at each step."""
    model, opt = _model()
    cfg = CheckpointConfig(checkpoint_dir=root, **config)
    saved = {}
    with CheckpointManager(cfg, model=model, optimizer=opt) as mgr:
        mgr.restore()
        for step in steps:
            loss = model(torch.randn(8, 32)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step=step, metrics={"loss": float(abs(10 - step))})  # best at step 10
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def _steps(root: Path) -> dict[int, Path]:
    return {read_manifest(p).step: p for p in root.iterdir() if (p / MANIFEST_NAME).is_file()}


def test_only_the_newest_keep_the_optimizer_and_the_rest_keep_their_weights(tmp_path, capsys):
    saved = _train(str(tmp_path), range(1, 7), keep_latest=3, save_top_k=2, monitor="loss",
                   keep_optimizer_latest=1)
    steps = _steps(tmp_path)
    assert sorted(steps) == [4, 5, 6]  # top-2 (5, 6) and the 3 newest
    for step, path in steps.items():
        manifest = read_manifest(path)
        if step == 6:
            assert "optim" in manifest.states and (path / "optim").is_dir() and not manifest.pruned
        else:
            assert "optim" not in manifest.states and not (path / "optim").exists()
            assert manifest.pruned["optim"].startswith("keep_optimizer_latest=1")
            assert manifest.pruned_paths == {"optim": "optim"}
            assert not [f for f in manifest.files if f.startswith("optim/")]
            assert not list(path.glob(".trash-*"))
    # every step verifies; list says which are weights only
    for path in steps.values():
        assert main(["verify", str(path)]) == 0
    capsys.readouterr()
    assert main(["list", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert listed.count("optim pruned: weights only") == 2, listed
    # a full resume from a pruned checkpoint is refused, saying what and how; the weights load bitwise
    model, opt = _model()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=model, optimizer=opt) as mgr:
        with pytest.raises(CheckpointMismatchError, match=r"its 'optim' state was removed \(keep_optimizer_latest=1"):
            mgr.restore(steps[4])
        with pytest.raises(CheckpointMismatchError, match=r"states=\['model', 'optim', 'rng'\]"):
            mgr.restore(steps[4])
        info = mgr.restore(steps[4], states=["model", "rng"])
        assert info.step == 4
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[4][k]), k
        assert mgr.restore().step == 6  # the newest still resumes whole
    # consolidated into a Hugging Face-style bundle, the pruned step still verifies
    assert main(["consolidate", str(steps[5])]) == 0
    assert main(["verify", str(steps[5])]) == 0
    assert "optim" not in read_manifest(steps[5]).states


def test_the_prune_command_removes_optimizer_state_by_hand(tmp_path, capsys):
    _train(str(tmp_path), range(1, 5))
    assert main(["prune", str(tmp_path), "--keep-optimizer-latest", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would remove the optimizer state of") == 2 and all((p / "optim").is_dir()
                                                                          for p in _steps(tmp_path).values())
    assert main(["prune", str(tmp_path), "--keep-optimizer-latest", "2"]) == 0
    steps = _steps(tmp_path)
    assert [s for s, p in sorted(steps.items()) if (p / "optim").is_dir()] == [3, 4]
    assert main(["prune", str(tmp_path), "--keep-optimizer-latest", "0"]) == 2  # a clear error, not a no-op


_KILLED = """
import os, signal, sys, torch
from ckptio import CheckpointConfig, CheckpointManager, _faults
def die(name):
    if name == "retention.optimizer_after_manifest":
        os.kill(os.getpid(), signal.SIGKILL)
_faults.set_hook(die)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 32)).sum().backward()
opt.step()
with CheckpointManager(CheckpointConfig(checkpoint_dir=sys.argv[1], keep_optimizer_latest=1), model=model,
                       optimizer=opt) as mgr:
    for step in (1, 2):
        mgr.save(step=step)
"""


@pytest.mark.slow  # a real process killed
def test_a_kill_between_manifest_and_files_leaves_garbage_the_next_save_collects(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_KILLED)
    root = tmp_path / "ckpt"
    out = run_script(str(script), str(root), timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    first = root / "epoch_0_step_1"
    manifest = read_manifest(first)
    assert "optim" in manifest.pruned and (first / "optim").is_dir()  # the garbage: referred to by nothing
    assert main(["verify", str(first)]) == 0  # the step is whole for what it still holds
    _train(str(root), range(3, 4), keep_optimizer_latest=1)  # the next save's pass collects it
    assert not (first / "optim").exists() and not list(first.glob(".trash-*"))
    assert read_manifest(root / "epoch_0_step_2").pruned and (root / "epoch_0_step_3" / "optim").is_dir()


@pytest.mark.parametrize("edit", ["outside", "over the model", "the whole step", "not pruned"])
def test_a_manifest_whose_pruned_folders_overlap_what_it_keeps_is_refused(tmp_path, edit):
    from ckptio.engine.manifest import _self_checksum

    _train(str(tmp_path), range(1, 3), keep_optimizer_latest=1)
    path = tmp_path / "epoch_0_step_1" / MANIFEST_NAME
    data = json.loads(path.read_text())
    data.pop("manifest_checksum")
    data["pruned_paths"] = {"optim": {"outside": "../../victim", "over the model": "model",
                                      "the whole step": ".", "not pruned": "optim"}[edit]}
    if edit == "not pruned":
        data["pruned"] = {}
    data["manifest_checksum"] = _self_checksum(data)
    path.write_text(json.dumps(data))
    (tmp_path / "victim").mkdir()
    with pytest.raises(Exception) as err:
        read_manifest(path.parent)
    assert str(path) in str(err.value) and "pruned" in str(err.value)
    _train(str(tmp_path), range(3, 4), keep_optimizer_latest=1)  # a save's pass over it touches nothing
    assert (tmp_path / "victim").is_dir() and (path.parent / "model").is_dir()


def test_in_a_bucket_the_pruned_objects_go_and_the_weights_stay(bucket):
    from ckptio.storage import s3 as s3mod

    root = f"s3://{bucket}/run"
    saved = _train(root, range(1, 4), keep_optimizer_latest=1)
    keys = [o["Key"] for page in s3mod.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])]
    with_optim = sorted({k.split("/")[1] for k in keys if "/optim/" in k})
    assert with_optim == ["epoch_0_step_3"], with_optim
    model, opt = _model()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt) as mgr:
        with pytest.raises(CheckpointMismatchError, match="its 'optim' state was removed"):
            mgr.restore(f"{root}/epoch_0_step_2")
        mgr.restore(f"{root}/epoch_0_step_2", states=["model"])
        assert all(torch.equal(v, saved[2][k]) for k, v in model.state_dict().items())
    assert main(["verify", f"{root}/epoch_0_step_1"]) == 0


def _scheduled(root: str, steps: range, **config: object) -> None:
    """Train with lr 0.01 decayed by 0.9 at every step (``StepLR``), saving at each."""
    model, _ = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root, **config), model=model, optimizer=opt,
                           lr_scheduler=sched) as mgr:
        for step in steps:
            model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            mgr.save(step=step)


def _advice(err: pytest.ExceptionInfo) -> list[str]:
    import ast
    import re

    return ast.literal_eval(re.search(r"states=(\[[^\]]*\])", str(err.value)).group(1))


def test_a_pruned_step_keeps_the_hyper_parameters_and_its_resume_continues_the_schedule(tmp_path, caplog):
    """Issue 67, row 3: pruning removes the moments, not the parameter groups. Following the refusal's advice in a
    fresh process restores each group's lr (and ``initial_lr``, betas...) with the scheduler, so the schedule
    continues; the moments start from zero, and the log says so."""
    _scheduled(str(tmp_path), range(1, 5), keep_optimizer_latest=1)
    step3 = _steps(tmp_path)[3]
    assert "optim" in read_manifest(step3).pruned
    model, _ = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=model, optimizer=opt,
                           lr_scheduler=sched) as mgr:
        with pytest.raises(CheckpointMismatchError, match="its 'optim' state was removed") as err:
            mgr.restore(step3)
        states = _advice(err)
        assert "optim" in states and "lr_scheduler" in states
        with caplog.at_level("INFO", logger="ckptio"):
            assert mgr.restore(step3, states=states).step == 3
    assert any("moments start from zero" in r.getMessage() for r in caplog.records), caplog.text
    assert not opt.state
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(0.01 * 0.9 ** 3) and group["initial_lr"] == 0.01
    assert isinstance(group["betas"], tuple) and group["weight_decay"] == 0.01
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.006561)  # not 0.009: the schedule did not restart


def test_a_step_pruned_by_earlier_versions_restores_as_before(tmp_path):
    """A step pruned before the hyper-parameters were kept (no ``pruned_groups`` in its manifest): refused whole,
    loaded without its optimizer as the advice says (the optimizer untouched), and refused when asked for it."""
    from ckptio.engine.manifest import _self_checksum

    _scheduled(str(tmp_path), range(1, 3), keep_optimizer_latest=1)
    step1 = _steps(tmp_path)[1]
    path = step1 / MANIFEST_NAME
    data = json.loads(path.read_text())
    assert data.pop("pruned_groups")
    data.pop("manifest_checksum")
    data["manifest_checksum"] = _self_checksum(data)
    path.write_text(json.dumps(data))
    model, _ = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=model, optimizer=opt,
                           lr_scheduler=sched) as mgr:
        with pytest.raises(CheckpointMismatchError, match="its 'optim' state was removed") as err:
            mgr.restore(step1)
        assert "optim" not in _advice(err)
        assert mgr.restore(step1, states=_advice(err)).step == 1
        assert opt.param_groups[0]["lr"] == 0.5 and sched.last_epoch == 1  # the optimizer as it was
        with pytest.raises(CheckpointMismatchError, match="its 'optim' state was removed"):
            mgr.restore(step1, states=["model", "optim"])
