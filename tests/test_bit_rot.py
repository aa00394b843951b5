"""Bit rot between saves (issue 67): a run that shares its frozen tensors' files between steps saves, then one random
byte of one random file of its folder flips, 100 times over.

After each flip, a fresh process state (new objects, a new manager) resumes: it must come back bitwise equal to the
newest step that the flip left undamaged, or be told by name that none is left; and while two or more steps are
kept, one flipped file never leaves none (no single file holds the only copy of a state). The live run then saves
once more with the damage still on disk: the step it writes must verify byte for byte (a save never links to or
refers to bytes it has not checked). The byte is then flipped back, so that faults do not pile up and each trial is
about one damaged file. ``CKPTIO_ROT_TRIALS`` changes the number of trials (default 100).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.engine.manifest import MANIFEST_NAME, check_files, read_manifest
from ckptio.errors import CheckpointError
from ckptio.storage import open_storage

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 256))
    model[0].weight.requires_grad_(False)  # frozen: its file is shared from save to save
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randint(0, 256, (4, 8), generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _config(root: str) -> CheckpointConfig:
    return CheckpointConfig(checkpoint_dir=root, keep_latest=3)


def _committed(root: str) -> dict[int, str]:
    """step -> folder name of every committed step directory."""
    out = {}
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not name.startswith(".") and os.path.isdir(path) and not os.path.islink(path) \
                and os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            out[read_manifest(open_storage(root).folder(name)).step] = name
    return out


def _files(root: str) -> list[str]:
    """Every regular file of the folder (links to folders, the pointers, are not followed)."""
    out = []
    for top, dirs, names in os.walk(root):
        out += [os.path.join(top, n) for n in names if not os.path.islink(os.path.join(top, n))]
    return sorted(out)


def _holders(root: str, path: str, steps: dict[int, str]) -> set[int]:
    """The steps whose folder holds the file ``path`` (itself or a hard link to it)."""
    ino = os.stat(path).st_ino
    return {s for s, name in steps.items()
            if any(os.stat(f).st_ino == ino for f in _files(os.path.join(root, name)))}


def _verify_clean(root: str, name: str) -> None:
    folder = open_storage(root).folder(name)
    assert not check_files(folder, read_manifest(folder), checksums=True), f"{name} was saved with damaged bytes"


def test_one_flipped_byte_costs_at_most_the_steps_that_hold_it(tmp_path):
    n = int(os.environ.get("CKPTIO_ROT_TRIALS", "100"))
    rng = random.Random(67)
    root = str(tmp_path / "run")
    model, opt = _objects()
    reference: dict[int, dict[str, torch.Tensor]] = {}
    mgr = CheckpointManager(_config(root), model=model, optimizer=opt, rng=False)
    step, outcomes = 0, {"restored_newest": 0, "fell_back": 0, "none_left": 0, "harmless": 0, "shared": 0}
    try:
        for _ in range(2):
            step += 1
            _step(model, opt, step)
            mgr.save(step=step)
            reference[step] = _state(model, opt)
        for trial in range(n):
            steps = _committed(root)
            path = rng.choice(_files(root))
            damaged = _holders(root, path, steps)
            outcomes["shared"] += len(damaged) > 1  # a file held by several steps (hard links) was hit
            size, ino = os.path.getsize(path), os.stat(path).st_ino
            if size == 0:
                continue
            offset, bit = rng.randrange(size), 1 << rng.randrange(8)
            with open(path, "r+b") as f:
                f.seek(offset)
                old = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([old ^ bit]))
            intact = sorted(set(steps) - damaged)
            if len(steps) >= 2:
                assert intact, f"trial {trial}: one flipped byte of {path} damaged every kept step {sorted(steps)}"
            fresh_model, fresh_opt = _objects()
            fresh_model[0].weight.data.zero_()  # nothing may come from the initial values
            try:
                with CheckpointManager(_config(root), model=fresh_model, optimizer=fresh_opt, rng=False) as other:
                    info = other.restore()
            except CheckpointError as e:
                assert not intact, f"trial {trial}: flipped {path}@{offset}; step {intact[-1]} is intact, yet: {e}"
                outcomes["none_left"] += 1
            else:
                assert info is not None, f"trial {trial}: started fresh beside intact steps {intact}"
                got = _state(fresh_model, fresh_opt)
                expected = reference[info.step]
                assert expected.keys() == got.keys()
                for k in expected:
                    assert torch.equal(expected[k], got[k]), \
                        f"trial {trial}: flipped {path}@{offset}; step {info.step} restored {k} wrong"
                if intact:
                    assert info.step >= intact[-1], f"trial {trial}: restored {info.step}, not the intact {intact[-1]}"
                key = "harmless" if info.step in damaged else \
                    "restored_newest" if info.step == max(steps) else "fell_back"
                outcomes[key] += 1
            # the live run saves with the damage still on disk: what it writes must be whole
            step += 1
            _step(model, opt, step)
            saved = mgr.save(step=step)
            reference[step] = _state(model, opt)
            _verify_clean(root, os.path.basename(str(saved)))
            if os.path.exists(path) and os.stat(path).st_ino == ino:  # flipped back: each trial is one damaged file
                with open(path, "r+b") as f:
                    f.seek(offset)
                    f.write(bytes([old]))
    finally:
        mgr.close()
    print(outcomes)
    assert outcomes["fell_back"] > 0 and outcomes["restored_newest"] > 0 and outcomes["shared"] > 0, outcomes
