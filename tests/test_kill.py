"""SIGKILL a rank at a random moment of a save loop: the next run resumes from a complete checkpoint."""

from __future__ import annotations

import random
import signal
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager, committed_checkpoints
from ckptio.layout import TMP_PREFIX
from distributed import kill_all, start_ranks

WIDTH, DEPTH = 1024, 4  # 16 MiB of fp32 weights: a save takes long enough to be hit mid-write


class Step:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def make_model() -> torch.nn.Module:
    import torch.distributed as dist

    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    if dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    return model


def _save_forever(root: str, fmt: str) -> None:
    model, counter = make_model(), Step()
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=root, model_save_format=fmt),
                            model=model, step_scheduler=counter)
    while True:
        counter.step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(counter.step)  # every value of a checkpoint equals its step
        mgr.save()


def _check_resumable(root: str, fmt: str) -> int:
    model, counter = make_model(), Step()
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=root, model_save_format=fmt),
                            model=model, step_scheduler=counter, rng=False)
    info = mgr.restore()
    assert info is not None and not info.path.name.startswith(".")
    assert counter.step == info.step
    for name, p in model.named_parameters():
        assert torch.all(p == info.step), f"{info.path}: {name} does not hold step {info.step}'s values"
    return info.step


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_sigkill_during_saves_never_leaves_a_torn_checkpoint(tmp_path, fmt):
    rng = random.Random(1234)
    tally = {"trials": 0, "killed_mid_write": 0}
    for trial in range(3):
        root = str(tmp_path / f"t{trial}")
        with tempfile.TemporaryDirectory() as store:
            procs = start_ranks(2, _save_forever, {"root": root, "fmt": fmt}, store)
            try:
                deadline = time.monotonic() + 120
                while not committed_checkpoints(root):
                    assert time.monotonic() < deadline, "no checkpoint was committed within 120 s"
                    assert all(p.is_alive() for p in procs), "a saving rank died on its own"
                    time.sleep(0.02)
                before = {e.name for e in committed_checkpoints(root)}
                time.sleep(rng.uniform(0.0, 1.5))
                victim = procs[rng.randrange(2)]
                os.kill(victim.pid, signal.SIGKILL)
                mid_write = any(p.name.startswith(TMP_PREFIX) for p in Path(root).iterdir())
            finally:
                kill_all(procs)
        tally["trials"] += 1
        tally["killed_mid_write"] += int(mid_write)
        after = {e.name for e in committed_checkpoints(root)}
        assert before <= after, f"committed checkpoints were lost: {sorted(before - after)}"
        step = _check_resumable(root, fmt)
        assert step == max(e.step for e in committed_checkpoints(root))
        # the next save of a new run sweeps leftovers of the killed one
        mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=root, model_save_format=fmt), rng=False,
                                extra_states={"s": Step()})
        mgr.save(step=10_000)
        assert not [p for p in Path(root).iterdir() if p.name.startswith(TMP_PREFIX)]
    print(f"kill tally ({fmt}): {tally}")
