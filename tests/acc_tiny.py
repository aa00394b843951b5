"""A tiny accelerate training loop shared by ``test_accelerate.py`` and its runner ``acc_run.py``.

``train`` builds the same model, optimizer, scheduler and data every time (seeded), prepares them on the given
``Accelerator`` class, registers a ``Counter`` for checkpointing, trains ``STEPS`` steps with ``save_state`` every
``EVERY`` and returns the final weights, optimizer moments, learning rate and the counter's sum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

STEPS, EVERY, SAMPLES = 12, 3, 96


class Counter:
    """A registered object: how many steps were taken, and the running sum of their batches."""

    def __init__(self) -> None:
        self.n, self.total = 0, torch.zeros(())

    def state_dict(self) -> dict:
        return {"n": self.n, "total": self.total.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.total = sd["n"], sd["total"]


def accelerator(cls: type, root: Path, limit: int | None = None, **kw: Any) -> Accelerator:
    return cls(cpu=True, **kw, project_config=ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True,
                                                             total_limit=limit),
               dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))


def train(root: Path, cls: type, stop: int = STEPS, resume: bool = False, limit: int | None = None,
          on_step: Callable[[int], None] | None = None, skip: bool = True, clip: bool = False, **kw: Any) -> dict:
    """Train for ``STEPS`` steps with a save every ``EVERY``, stopping after ``stop`` steps; ``on_step(done)`` runs
    after every step and its save; ``kw`` go to the accelerator (``async_save=True``, ``on_preemption``: then
    ``save_on_preemption`` ends each step, and ``preempted`` in the result is the step it stopped at, or 0);
    ``end_training`` at the end. ``skip``: a resumed run skips the batches the steps done took (``False``: it
    starts its epoch over, another data order); ``clip``: ``clip_grad_norm_`` each step."""
    torch.manual_seed(0)
    acc = accelerator(cls, root, limit, **kw)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4,
                                       shuffle=True)
    model, opt, sched, data = acc.prepare(model, opt, sched, data)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    done = 0
    if resume:
        acc.load_state()
        done = counter.n
        if cls is Accelerator:  # its load_state leaves the counter at 0: the next save_state would collide
            acc.project_configuration.iteration = len(list((root / "checkpoints").iterdir()))
    batches = acc.skip_first_batches(data, done) if done and skip else data
    for xb, yb in batches:
        if done >= stop:
            break
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        if clip:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        done += 1
        # the same on every rank (accelerate saves a registered object from the main process only): the sum of the
        # batches of all ranks
        counter.n, counter.total = done, counter.total + (acc.reduce(xb.sum(), "sum") if acc.num_processes > 1
                                                          else xb.sum())
        if done % EVERY == 0:
            acc.save_state()
        if on_step is not None:
            on_step(done)
        if kw.get("on_preemption") and acc.save_on_preemption(step=done) is not None:  # "exit" does not come back
            break
    acc.end_training()  # a background save is committed before the results are read
    out = {f"w/{k}": v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    out.update({f"o/{i}/{k}": v.clone() for i, s in enumerate(opt.optimizer.state.values()) for k, v in s.items()})
    # (the global RNG is not compared: a DataLoader draws its base seed from it when an iterator starts, which a
    # resumed run does after load_state and the straight run did at step 0; that is the DataLoader's, not ours)
    out.update(lr=torch.tensor(opt.param_groups[0]["lr"]), total=counter.total)
    out["main"] = torch.tensor(acc.is_main_process)
    if kw.get("on_preemption"):
        out["preempted"] = torch.tensor(done if acc.ckptio_preempted else 0)
    return out
