"""Train N steps straight, or K steps + save + resume in a fresh process to N: identical to the bit.

Dropout is on and the loader shuffles, so the RNG streams and the data position must both be restored.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

pytestmark = pytest.mark.slow  # multi-process: left out of the quick loop (-m 'not slow')

FORMATS = ("safetensors", "torch_save")
N = 16


def _uninterrupted(root: str) -> dict:
    from toy import Run, full_state

    run = Run(f"{root}/straight", max_steps=N)
    run.train()
    return {"state": full_state(run.model, run.opt), "losses": run.losses}


def _first_part(root: str, k: int, async_save: bool = False) -> dict:
    from toy import Run

    for fmt in FORMATS:
        run = Run(f"{root}/{fmt}", fmt, max_steps=N, async_save=async_save)
        # a background save is written while training goes on: three more steps update everything
        run.train(save_at=(k,), stop_at=k + 3 if async_save else k)
        run.mgr.close()
    return {}


def _resume(root: str) -> dict:
    from toy import Run, full_state

    out = {}
    for fmt in FORMATS:
        run = Run(f"{root}/{fmt}", fmt, max_steps=N)
        info = run.mgr.restore()
        assert info is not None and info.step == run.steps.step
        run.train()
        out[fmt] = {"state": full_state(run.model, run.opt), "losses": run.losses, "counter": run.counter.seen}
    return out


@pytest.mark.parametrize("world,k,async_save", [(1, 7, False), (2, 12, False), (2, 9, True)],
                         ids=["1rank-midepoch", "2ranks-epoch-boundary", "2ranks-async-save"])
def test_resume_is_bitwise_exact(tmp_path, world, k, async_save):
    root = str(tmp_path)
    straight = run_ranks(world, _uninterrupted, root=root)[0]
    run_ranks(world, _first_part, root=root, k=k, async_save=async_save)
    resumed = run_ranks(world, _resume, root=root)[0]
    for fmt in FORMATS:
        got = resumed[fmt]
        assert sorted(got["losses"]) == list(range(k + 1, N + 1)), f"{fmt}: steps repeated or skipped"
        for step in range(k + 1, N + 1):
            assert got["losses"][step] == straight["losses"][step], f"{fmt}: loss at step {step} differs"
        for key, ref in straight["state"].items():
            assert torch.equal(got["state"][key], ref), f"{fmt}: {key} differs at the end"
        assert got["counter"] == N * 4, "the registered user object was not restored"
