"""A restored LR scheduler state and optimizer hyper-parameters are checked against the live objects before they are
applied (``ckptio.state.hyper``): a state of another scheduler class, a value of another kind or a number that is not
finite is refused by name, instead of loading and making the next step raise or the weights NaN (issue 67, row 11).
The DeepSpeed side (its ``WarmupLR`` state given to a torch ``StepLR``) is in ``test_deepspeed.py``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointError, CheckpointManager
from ckptio.engine.manifest import _self_checksum
from ckptio.storage.checksum import file_checksum


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.999))
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(model, opt, sched, steps: int) -> None:
    for i in range(steps):
        model(torch.full((2, 4), float(i + 1))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _manager(root, model, opt, sched) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(checkpoint_dir=str(root)), model=model, optimizer=opt, lr_scheduler=sched,
                             rng=False)


def _save(root, edit=None) -> None:
    """A checkpoint of step 3; ``edit(model, opt, sched)`` runs just before the save."""
    model, opt, sched = _objects()
    _train(model, opt, sched, 3)
    if edit is not None:
        edit(model, opt, sched)
    with _manager(root, model, opt, sched) as mgr:
        mgr.save(step=3)


def _replace_scheduler_state(root, edit) -> None:
    """Rewrite the step's ``lr_scheduler.pt`` with ``edit(state)`` and record it in a re-sealed manifest: what a
    hand-made or copied-in checkpoint holds (its checksums say nothing about where its states came from)."""
    step = next(p for p in root.iterdir() if p.name.startswith("epoch_"))
    state = torch.load(step / "lr_scheduler.pt", weights_only=True)
    state = edit(state)
    torch.save(state, step / "lr_scheduler.pt")
    data = json.loads((step / "manifest.json").read_text())
    data["files"]["lr_scheduler.pt"] = (step / "lr_scheduler.pt").stat().st_size
    data["checksums"]["lr_scheduler.pt"] = file_checksum(step / "lr_scheduler.pt")
    data.pop("manifest_checksum", None)
    data["manifest_checksum"] = _self_checksum(data)
    (step / "manifest.json").write_text(json.dumps(data))


SCHEDULER_STATES = {
    "a key of the scheduler's object": (lambda s: {**s, "optimizer": "hijacked"}, r"entries StepLR does not have"),
    "a step size of 0": (lambda s: {**s, "step_size": 0}, r"cannot compute its learning rates.*ZeroDivisionError"),
    "a learning rate as text": (lambda s: {**s, "base_lrs": ["0.01"]}, r"'base_lrs'\[0\] is '0.01' \(a str"),
    "a gamma that is not a number": (lambda s: {**s, "gamma": float("nan")}, r"'gamma' is nan \(not finite\)"),
    "DeepSpeed's WarmupLR state": (lambda s: {"last_batch_iteration": 3}, r"not the state of this run's StepLR"),
    "base_lrs of another number of groups": (lambda s: {**s, "base_lrs": [0.01, 0.01]}, r"2 values, not 1"),
}


@pytest.mark.parametrize("case", list(SCHEDULER_STATES))
def test_a_scheduler_state_that_does_not_fit_is_refused_before_it_is_applied(tmp_path, case):
    edit, message = SCHEDULER_STATES[case]
    _save(tmp_path)
    _replace_scheduler_state(tmp_path, edit)
    model, opt, sched = _objects()
    before = dict(sched.__dict__)
    with pytest.raises(CheckpointError, match=message) as exc:
        _manager(tmp_path, model, opt, sched).restore()
    assert "lr_scheduler.pt" in str(exc.value)
    assert sched.__dict__ == before  # nothing of it was applied: the next step runs as a fresh run's


GROUPS = {
    "an lr as text": (lambda g: g.__setitem__("lr", "0.01"), r"lr' is '0.01' \(a str, not a number\)"),
    "betas with a NaN": (lambda g: g.__setitem__("betas", (math.nan, 0.999)), r"betas'\[0\] is nan \(not finite"),
    "an eps that is infinite": (lambda g: g.__setitem__("eps", math.inf), r"eps' is inf \(not finite"),
    "a bool for a number": (lambda g: g.__setitem__("weight_decay", True), r"weight_decay' is True \(a bool"),
}


@pytest.mark.parametrize("case", list(GROUPS))
def test_optimizer_hyper_parameters_that_do_not_fit_are_refused(tmp_path, case):
    edit, message = GROUPS[case]
    _save(tmp_path, lambda model, opt, sched: edit(opt.param_groups[0]))  # saved as the live optimizer held them
    model, opt, sched = _objects()
    with pytest.raises(CheckpointError, match=message) as exc:
        _manager(tmp_path, model, opt, sched).restore()
    assert "optim" in str(exc.value)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert not opt.state  # nothing applied: the next step is a fresh optimizer's, never a NaN


def test_an_untouched_state_restores_and_continues(tmp_path):
    """The check lets the states a run saves through: the schedule and the lr continue where they were."""
    _save(tmp_path)
    model, opt, sched = _objects()
    _manager(tmp_path, model, opt, sched).restore()
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == 0.005
    _train(model, opt, sched, 1)
    assert sched.last_epoch == 4 and opt.param_groups[0]["lr"] == 0.0025


def test_the_check_changes_nothing_and_takes_every_torch_scheduler():
    """``check`` on a live scheduler and its own state of every torch class (the ones that keep ``inf``, as
    ``ReduceLROnPlateau``'s ``best``, included): no error, nothing changed."""
    from test_schedulers import _schedulers

    from ckptio.state.hyper import check

    for name in _schedulers(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
        sched = _schedulers(opt)[name]()
        for _ in range(3):
            opt.step()
            sched.step(1.0) if name == "ReduceLROnPlateau" else sched.step()
        state, groups = sched.state_dict(), [dict(g) for g in opt.param_groups]
        check(sched, state, name)
        check(opt, opt.state_dict(), name)
        assert sched.state_dict().keys() == state.keys() and [dict(g) for g in opt.param_groups] == groups, name
