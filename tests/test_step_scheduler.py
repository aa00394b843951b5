"""``StepScheduler``: the loop the docs show (README, getting-started) saves the end of training, whether the
interval divides ``max_steps`` or not, and with ``ckpt_every_steps="auto"``."""

from __future__ import annotations

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager, StepScheduler, committed_checkpoints


def _docs_loop(root: str, steps: StepScheduler, **config: object) -> list[int]:
    """The training loop of docs/getting-started.md, as written there; the steps it saved."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=root, **config), model=model, optimizer=opt,
                            step_scheduler=steps)
    mgr.restore()
    while not steps.done:
        for (xb,) in loader:
            model(xb).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            steps.step += 1
            if steps.is_ckpt_step():
                mgr.save()
            if steps.done:
                break
        else:
            steps.epoch += 1
    mgr.close()
    return [e.step for e in committed_checkpoints(root)]


def test_the_last_step_is_a_checkpoint_step(tmp_path):
    """max_steps=45, every 20: saved at 20, 40 and 45 (the end of training was lost before)."""
    steps = StepScheduler(max_steps=45, ckpt_every_steps=20)
    assert _docs_loop(str(tmp_path), steps) == [20, 40, 45]
    assert StepScheduler(max_steps=45, ckpt_every_steps=None).is_ckpt_step() is False  # None: never by schedule


def test_auto_saves_the_last_step_too(tmp_path):
    steps = StepScheduler(max_steps=45, ckpt_every_steps="auto")
    saved = _docs_loop(str(tmp_path), steps, mtbf="1h", keep_latest=100)
    assert saved and saved[-1] == 45, saved


@pytest.mark.parametrize("every", [5, 9])
def test_a_resumed_run_that_is_done_saves_nothing_more(tmp_path, every):
    """Rerunning a finished run restores its last step and leaves the loop at once."""
    first = _docs_loop(str(tmp_path), StepScheduler(max_steps=9, ckpt_every_steps=every))
    assert first[-1] == 9
    assert _docs_loop(str(tmp_path), StepScheduler(max_steps=9, ckpt_every_steps=every)) == first
