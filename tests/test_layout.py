"""Step directory names, pointers, discovery and the resumable loader, without any model."""

from __future__ import annotations

import os

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointError, CheckpointManager, ResumableDataLoader, committed_checkpoints
from ckptio.engine.layout import format_step_name, parse_step_name, resolve_restore_path
from ckptio.storage import read_pointer, write_pointer


class Box:
    def __init__(self, v=0):
        self.v = v

    def state_dict(self):
        return {"v": self.v}

    def load_state_dict(self, sd):
        self.v = sd["v"]


def test_names_round_trip():
    t = "megatron_gpt--{val_loss:.3f}-{step}-{consumed_samples}"
    name = format_step_name(t, step=1000, epoch=0, metrics={"val_loss": 0.4321}, counters={"consumed_samples": 32000})
    assert name == "megatron_gpt--0.432-1000-32000"
    assert parse_step_name(t, name) == {"val_loss": 0.432, "step": 1000, "consumed_samples": 32000}
    assert parse_step_name("epoch_{epoch}_step_{step}", "epoch_2_step_40") == {"epoch": 2, "step": 40}
    # NeMo / Lightning style: field names inserted where the template does not spell them
    named = format_step_name(t, step=1000, epoch=0, metrics={"val_loss": 0.4321},
                             counters={"consumed_samples": 32000.0}, insert_field_names=True)
    assert named == "megatron_gpt--val_loss=0.432-step=1000-consumed_samples=32000.0"
    assert parse_step_name(t, named, insert_field_names=True) == {"val_loss": 0.432, "step": 1000,
                                                                  "consumed_samples": 32000.0}
    assert format_step_name("epoch_{epoch}_step_{step}", step=20, epoch=0, insert_field_names=True) == "epoch_0_step_20"
    assert parse_step_name("epoch_{epoch}_step_{step}", "LATEST") is None


def test_discovery_orders_by_step_not_name_or_mtime(tmp_path):
    box = Box()
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), name_template="ckpt-{step}",
                                             auto_insert_field_names=False),
                            extra_states={"box": box}, rng=False)
    for step in (9, 100, 20):
        box.v = step
        mgr.save(step=step)
    os.utime(tmp_path / "ckpt-9", (2e9, 2e9))  # newest mtime must not matter
    assert [e.step for e in committed_checkpoints(tmp_path)] == [9, 20, 100]
    assert resolve_restore_path(tmp_path, None).name == "ckpt-100"
    assert read_pointer(tmp_path, "LATEST") == "ckpt-20"  # the pointer follows the last save
    assert resolve_restore_path(tmp_path, "LATEST").name == "ckpt-20"
    assert resolve_restore_path(tmp_path, "ckpt-9").name == "ckpt-9"
    fresh = Box()
    CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), name_template="ckpt-{step}", auto_insert_field_names=False),
                      extra_states={"box": fresh}, rng=False).restore()
    assert fresh.v == 100


def test_uncommitted_and_hostile_pointers_are_ignored(tmp_path):
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), extra_states={"b": Box(1)}, rng=False)
    mgr.save(step=1)
    (tmp_path / ".tmp-epoch_0_step_2-abc").mkdir()
    (tmp_path / "epoch_0_step_3").mkdir()  # no manifest: a crash before commit, or someone else's folder
    assert resolve_restore_path(tmp_path, None).name == "epoch_0_step_1"
    write_pointer(tmp_path, "LATEST", "epoch_0_step_1")
    os.remove(tmp_path / "LATEST")
    os.symlink("../../etc", tmp_path / "LATEST")
    with pytest.raises(CheckpointError, match="LATEST: the pointer names '../../etc'"):
        read_pointer(tmp_path, "LATEST")
    assert resolve_restore_path(tmp_path, "LATEST").name == "epoch_0_step_1"  # falls back to discovery


def test_text_pointer_when_symlinks_are_unavailable(tmp_path):
    (tmp_path / "LATEST.txt").write_text("epoch_0_step_5\n")
    assert read_pointer(tmp_path, "LATEST") == "epoch_0_step_5"


@pytest.mark.parametrize("new_world", [1, 2, 4])
def test_loader_resumes_mid_epoch_on_any_world_size(new_world):
    data = torch.arange(64)
    straight = [b.tolist() for b in ResumableDataLoader(data, 4, seed=3, rank=0, world_size=1)]
    # two ranks consume 3 steps, then the run resumes on new_world ranks
    first = [ResumableDataLoader(data, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    seen = []
    for loader in first:
        it = iter(loader)
        seen += [x for _ in range(3) for x in next(it).tolist()]
    state = first[0].state_dict()
    assert state == first[1].state_dict() == {"epoch": 0, "consumed": 12, "seed": 3}
    rest = []
    for r in range(new_world):
        loader = ResumableDataLoader(data, 2, seed=3, rank=r, world_size=new_world)
        loader.load_state_dict(state)
        rest += [x for b in loader for x in b.tolist()]
    order = [x for b in straight for x in b]  # the epoch's permutation
    assert sorted(seen) == sorted(order[:12])
    assert len(set(rest)) == len(rest) and set(rest) <= set(order[12:]), "a sample was repeated"
    # only the tail that cannot fill one batch on every rank is dropped
    assert len(rest) > len(order) - 12 - 2 * new_world
