"""Every LR scheduler of ``torch.optim.lr_scheduler`` and the optimizer state round-trip exactly.

The scheduler is saved as a small state of its own (``lr_scheduler.pt``): DCP's flattening drops empty
containers, and ``LambdaLR`` with a bound method stores ``lr_lambdas: [{}]``, which then went missing on
load (``KeyError: 'lr_lambdas'``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim import lr_scheduler as S

from ckptio import CheckpointConfig, CheckpointManager


class Warmup:
    """A schedule given as a bound method: LambdaLR stores its ``__dict__`` (empty) instead of the function."""

    def factor(self, step: int) -> float:
        return min(1.0, (step + 1) / 3)


def _function(step: int) -> float:
    return 0.9 ** step


def _schedulers(opt: torch.optim.Optimizer) -> dict:
    return {
        "LambdaLR-function": lambda: S.LambdaLR(opt, _function),
        "LambdaLR-bound-method": lambda: S.LambdaLR(opt, Warmup().factor),
        "MultiplicativeLR": lambda: S.MultiplicativeLR(opt, _function),
        "StepLR": lambda: S.StepLR(opt, step_size=2, gamma=0.5),
        "MultiStepLR": lambda: S.MultiStepLR(opt, milestones=[2, 4], gamma=0.3),
        "ConstantLR": lambda: S.ConstantLR(opt, factor=0.5, total_iters=3),
        "LinearLR": lambda: S.LinearLR(opt, start_factor=0.2, total_iters=4),
        "ExponentialLR": lambda: S.ExponentialLR(opt, gamma=0.8),
        "PolynomialLR": lambda: S.PolynomialLR(opt, total_iters=6, power=2.0),
        "CosineAnnealingLR": lambda: S.CosineAnnealingLR(opt, T_max=5),
        "CosineAnnealingWarmRestarts": lambda: S.CosineAnnealingWarmRestarts(opt, T_0=3),
        "CyclicLR": lambda: S.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2),
        "OneCycleLR": lambda: S.OneCycleLR(opt, max_lr=0.1, total_steps=20),
        "SequentialLR": lambda: S.SequentialLR(opt, [S.LinearLR(opt, 0.5, total_iters=2), S.ExponentialLR(opt, 0.9)],
                                               milestones=[2]),
        "ChainedScheduler": lambda: S.ChainedScheduler([S.ConstantLR(opt, 0.5, total_iters=2),
                                                        S.LambdaLR(opt, Warmup().factor)]),
        "ReduceLROnPlateau": lambda: S.ReduceLROnPlateau(opt, patience=1, factor=0.5),
    }


def _same(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _setup(name: str, opt_kind: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = {"AdamW": lambda: torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01, betas=(0.8, 0.95)),
           "SGD": lambda: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)}[opt_kind]()
    return model, opt, _schedulers(opt)[name]()


def _train(model, opt, sched, steps: int) -> None:
    for i in range(steps):
        loss = model(torch.full((2, 4), float(i + 1))).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step(loss.item()) if isinstance(sched, S.ReduceLROnPlateau) else sched.step()


@pytest.mark.parametrize("opt_kind", ["AdamW", "SGD"])
@pytest.mark.parametrize("name", sorted(_schedulers(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))))
def test_scheduler_and_optimizer_round_trip_exactly(tmp_path, name, opt_kind):
    model, opt, sched = _setup(name, opt_kind)
    _train(model, opt, sched, 5)
    CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=model, optimizer=opt,
                      lr_scheduler=sched, rng=False).save(step=5)
    model2, opt2, sched2 = _setup(name, opt_kind)
    CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=model2, optimizer=opt2,
                      lr_scheduler=sched2, rng=False).restore()
    _same(sched.state_dict(), sched2.state_dict(), "scheduler")
    _same(opt.state_dict(), opt2.state_dict(), "optimizer")
    # and both continue identically
    _train(model, opt, sched, 3)
    _train(model2, opt2, sched2, 3)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
